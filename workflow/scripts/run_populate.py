from kvpool import logs, steps
from kvpool.cells import Cell

logs.to_log(snakemake.log[0])
steps.run_populate(snakemake.config, Cell.from_wildcards(snakemake.wildcards), snakemake.input.plan,
                   snakemake.input.prompts, snakemake.output.csv, snakemake.output.meta, snakemake.output.drive,
                   snakemake.output.power, snakemake.params.log_dir, digests_csv=snakemake.output.digests)
