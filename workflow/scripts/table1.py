from kvpool import logs, steps
from kvpool.cells import Cell

logs.to_log(snakemake.log[0])
cells = [Cell.from_name(name) for name in snakemake.params.cells]
steps.run_summary(snakemake.params.settings, cells, snakemake.input.reuse, snakemake.input.reuse_meta,
                  snakemake.input.validity, snakemake.input.telemetry, cells_csv=snakemake.output.cells,
                  csv_out=snakemake.output.csv, md_out=snakemake.output.md)
