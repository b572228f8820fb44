from kvpool.cells import Cell
from kvpool.measure import logs
from kvpool.report import tables

logs.to_log(snakemake.log[0])
shared = [Cell.from_name(name) for name in snakemake.params.cells]
inputs = snakemake.input
tables.run_tier_compare(snakemake.params.settings, shared, inputs.summaries, inputs.reuse, inputs.drive,
                        inputs.ceilings, tiers_csv=snakemake.output.tiers, csv_out=snakemake.output.csv,
                        md_out=snakemake.output.md)
