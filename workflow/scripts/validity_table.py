from kvpool.measure import logs
from kvpool.report import gate

logs.to_log(snakemake.log[0])
gate.run_validity_table(list(snakemake.input), snakemake.output[0])
