from kvpool import logs, steps
from kvpool.cells import cells

logs.to_log(snakemake.log[0])
shared = [cell for cell in cells(snakemake.config) if cell.arm == "shared"]
steps.run_tier_compare(snakemake.config, shared, snakemake.input.summaries, snakemake.input.reuse,
                       snakemake.input.ceilings, snakemake.output.csv, snakemake.output.md)
