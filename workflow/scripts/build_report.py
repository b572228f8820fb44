from kvpool.cells import Cell
from kvpool.measure import logs
from kvpool.report import page

logs.to_log(snakemake.log[0])
cells = [Cell.from_name(name) for name in snakemake.params.cells]
files = {name: list(snakemake.input[name]) for name in page.CELL_FILES}
page.build_report(snakemake.params.config, cells, files, list(snakemake.input.ceilings),
                  cell_table=snakemake.input.cell_table,
                  table1_csv=snakemake.input.table1,
                  tier_table=snakemake.input.tier_table or None, kv_bytes=snakemake.input.kv_bytes,
                  out_html=snakemake.output.html, figures_dir=snakemake.output.figures,
                  tables_dir=snakemake.output.tables, load=snakemake.input.load,
                  studyb=snakemake.params.studyb or None, peer=snakemake.input.get("peer") or None,
                  routers=snakemake.input.get("routers") or None, contexts=snakemake.input.get("contexts") or None,
                  breakdown=snakemake.input.get("breakdown") or None,
                  capacity=snakemake.input.get("capacity") or None,
                  trace_csv=snakemake.input.get("trace") or None)
