from kvpool import logs, steps

logs.to_log(snakemake.log[0])
steps.run_studyb_workload(snakemake.params.settings, snakemake.params.model, snakemake.output[0])
