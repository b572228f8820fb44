from kvpool import logs, steps
from kvpool.cells import Cell

logs.to_log(snakemake.log[0])
units = [(Cell.from_name(name), router) for name, router in snakemake.params.units]
steps.run_router_table(units, csvs=snakemake.input.csvs, metas=snakemake.input.metas, csv_out=snakemake.output.csv,
                       md_out=snakemake.output.md, figures_dir=snakemake.output.figures)
