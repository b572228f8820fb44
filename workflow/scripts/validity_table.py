from kvpool import logs, steps

logs.to_log(snakemake.log[0])
steps.run_validity_table(list(snakemake.input), snakemake.output[0])
