from kvpool.cells import Cell
from kvpool.measure import logs
from kvpool.report import trace

logs.to_log(snakemake.log[0])
units = [(Cell.from_name(name), router) for name, router in snakemake.params.units]
trace.run_trace_table(units, csvs=snakemake.input.csvs, metas=snakemake.input.metas, slo_s=snakemake.params.slo_s,
                      csv_out=snakemake.output.csv, md_out=snakemake.output.md, figures_dir=snakemake.output.figures)
