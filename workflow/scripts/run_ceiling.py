from kvpool.measure import logs
from kvpool.studies import study_a

logs.to_log(snakemake.log[0])
study_a.run_ceiling(snakemake.params.settings, snakemake.wildcards.tier, snakemake.output[0])
