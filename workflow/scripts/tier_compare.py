from kvpool.cells import Cell
from kvpool.measure import logs
from kvpool.report import tables

logs.to_log(snakemake.log[0])
shared = [Cell.from_name(name) for name in snakemake.params.cells]
tables.run_tier_compare(shared, snakemake.input.summaries, snakemake.input.reuse, snakemake.input.drive,
                        snakemake.input.ceilings, tiers_csv=snakemake.output.tiers, csv_out=snakemake.output.csv,
                        md_out=snakemake.output.md)
