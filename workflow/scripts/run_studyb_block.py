from kvpool import logs, steps

logs.to_log(snakemake.log[0])
steps.run_studyb_block(snakemake.params.settings, snakemake.wildcards.block, model=snakemake.params.model,
                       workload_path=snakemake.input.workload, plan_out=snakemake.output.plan,
                       manifest_out=snakemake.output.manifest, csv_out=snakemake.output.csv,
                       json_out=snakemake.output.meta, log_dir=snakemake.params.log_dir,
                       provenance_config=snakemake.config)
