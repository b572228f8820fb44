from kvpool.cells import Cell
from kvpool.measure import logs
from kvpool.report import contexts

logs.to_log(snakemake.log[0])
units = [(Cell.from_name(name), int(tokens)) for name, tokens in snakemake.params.units]
contexts.run_contexts_table(snakemake.params.settings, units, csvs=snakemake.input.csvs, metas=snakemake.input.metas,
                            csv_out=snakemake.output.csv, md_out=snakemake.output.md,
                            figures_dir=snakemake.output.figures)
