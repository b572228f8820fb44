from kvpool.measure import logs
from kvpool.report import breakdown

logs.to_log(snakemake.log[0])
breakdown.run_breakdown(snakemake.params.settings, snakemake.params.units, list(snakemake.input.csvs),
                        csv_out=snakemake.output.csv, md_out=snakemake.output.md,
                        figure_dir=str(snakemake.output.png).rsplit("/", 1)[0])
