from kvpool.cells import Cell
from kvpool.measure import logs
from kvpool.report import tables

logs.to_log(snakemake.log[0])
cells = [Cell.from_name(name) for name in snakemake.params.cells]
tables.run_table1(snakemake.params.settings, cells, snakemake.input.reuse, snakemake.input.reuse_meta,
                   snakemake.input.validity, snakemake.input.telemetry, snakemake.input.manifest,
                   cells_csv=snakemake.output.cells, csv_out=snakemake.output.csv, md_out=snakemake.output.md)
