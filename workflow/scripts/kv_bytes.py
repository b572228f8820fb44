from kvpool import logs, steps
from kvpool.cells import cells

logs.to_log(snakemake.log[0])
steps.run_kv_bytes(snakemake.config, cells(snakemake.config), list(snakemake.input), snakemake.output.csv,
                   snakemake.output.md)
