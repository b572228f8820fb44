from kvpool import logs, steps
from kvpool.cells import cells

logs.to_log(snakemake.log[0])
steps.build_report(snakemake.config, cells(snakemake.config), ".", cell_table=snakemake.input.cell_table,
                   tier_table=snakemake.input.tier_table, kv_bytes=snakemake.input.kv_bytes,
                   out_html=snakemake.output.html, figures_dir=snakemake.output.figures,
                   tables_dir=snakemake.output.tables)
