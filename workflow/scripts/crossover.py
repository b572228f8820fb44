from kvpool.measure import logs
from kvpool.report import crossover

logs.to_log(snakemake.log[0])
crossover.run_crossover(snakemake.params.settings, snakemake.params.study, locality_csv=snakemake.input.locality,
                        csv_out=snakemake.output.csv, md_out=snakemake.output.md, figures_dir=snakemake.output.figures)
