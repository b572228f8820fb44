from kvpool import logs, steps

logs.to_log(snakemake.log[0])
steps.run_ceiling(snakemake.params.settings, snakemake.wildcards.tier, snakemake.output[0])
