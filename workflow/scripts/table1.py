from kvpool import logs, steps
from kvpool.cells import cells

logs.to_log(snakemake.log[0])
steps.run_summary(snakemake.config, cells(snakemake.config), snakemake.input.reuse, snakemake.input.reuse_meta,
                  snakemake.input.validity, snakemake.input.telemetry, snakemake.output.csv, snakemake.output.md)
