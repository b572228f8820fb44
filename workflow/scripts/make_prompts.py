from kvpool import logs, steps

logs.to_log(snakemake.log[0])
steps.make_prompts(snakemake.params.model, snakemake.params.workload, snakemake.output[0])
