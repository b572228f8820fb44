from kvpool.cells import Cell
from kvpool.measure import logs
from kvpool.report import capacity

logs.to_log(snakemake.log[0])
units = [(Cell.from_name(name), float(fraction)) for name, fraction in snakemake.params.units]
capacity.run_capacity_table(units, csvs=snakemake.input.csvs, metas=snakemake.input.metas,
                            csv_out=snakemake.output.csv, md_out=snakemake.output.md,
                            figures_dir=snakemake.output.figures)
