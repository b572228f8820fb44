from kvpool.engine import prompts
from kvpool.measure import logs

logs.to_log(snakemake.log[0])
prompts.make_prompts(snakemake.params.model, snakemake.params.workload, snakemake.output[0])
