from kvpool import logs, steps
from kvpool.cells import Cell

logs.to_log(snakemake.log[0])
shared = [Cell.from_name(name) for name in snakemake.params.cells]
steps.run_tier_compare(shared, snakemake.input.summaries, snakemake.input.reuse, snakemake.input.drive,
                       snakemake.input.ceilings, tiers_csv=snakemake.output.tiers, csv_out=snakemake.output.csv,
                       md_out=snakemake.output.md)
