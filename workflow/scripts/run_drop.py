from kvpool import logs, steps

logs.to_log(snakemake.log[0])
steps.run_drop(snakemake.params.settings, snakemake.input.plan, snakemake.output[0])
