from kvpool import logs, steps

logs.to_log(snakemake.log[0])
steps.build_model(snakemake.output[0], snakemake.params.spec, snakemake.params.device)
