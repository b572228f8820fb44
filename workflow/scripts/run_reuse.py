from kvpool import logs, steps
from kvpool.cells import Cell

logs.to_log(snakemake.log[0])
steps.run_reuse(snakemake.config, Cell.from_wildcards(snakemake.wildcards), snakemake.input.plan,
                snakemake.input.prompts, snakemake.input.populate, snakemake.output.csv, snakemake.output.meta,
                snakemake.output.drive, snakemake.output.power, snakemake.output.digests,
                snakemake.params.log_dir, populate_digests=snakemake.input.populate_digests)
