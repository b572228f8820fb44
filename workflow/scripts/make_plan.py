from kvpool import logs, steps
from kvpool.cells import Cell

logs.to_log(snakemake.log[0])
steps.make_plan(snakemake.config, Cell.from_wildcards(snakemake.wildcards), snakemake.params.model,
                snakemake.output.plan, snakemake.output.manifest)
