from kvpool import logs, steps

logs.to_log(snakemake.log[0])
steps.run_reference(snakemake.params.settings, snakemake.params.model, snakemake.input.prompts, snakemake.output[0],
                    snakemake.params.log_dir)
