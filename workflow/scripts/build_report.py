from kvpool import logs, steps
from kvpool.cells import cells

logs.to_log(snakemake.log[0])
steps.build_report(snakemake.config, cells(snakemake.config), ".", snakemake.output.html,
                   snakemake.output.figures, snakemake.output.tables)
