from kvpool.measure import logs
from kvpool.studies import study_a

logs.to_log(snakemake.log[0])
study_a.run_drop(snakemake.params.settings, snakemake.input.plan, snakemake.output[0])
