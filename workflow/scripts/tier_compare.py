from kvpool import logs, steps
from kvpool.cells import cells

logs.to_log(snakemake.log[0])
shared = [cell for cell in cells(snakemake.config) if cell.arm == "shared"]
steps.run_tier_compare(snakemake.config, shared, snakemake.input.summaries, snakemake.input.reuse,
                       snakemake.input.drive, snakemake.input.ceilings,
                       tiers_csv=snakemake.output.tiers, csv_out=snakemake.output.csv, md_out=snakemake.output.md)
