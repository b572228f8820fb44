from kvpool import logs, steps
from kvpool.cells import cells

logs.to_log(snakemake.log[0])
steps.run_summary(snakemake.config, cells(snakemake.config), snakemake.input.reuse, snakemake.input.reuse_meta,
                  snakemake.input.validity, snakemake.input.telemetry, cells_csv=snakemake.output.cells,
                  csv_out=snakemake.output.csv, md_out=snakemake.output.md)
