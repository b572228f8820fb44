from kvpool.cells import Cell
from kvpool.measure import logs
from kvpool.studies import study_a

logs.to_log(snakemake.log[0])
cells = [Cell.from_name(name) for name in snakemake.params.cells]
study_a.run_kv_bytes(snakemake.params.settings, cells, list(snakemake.input), snakemake.output.csv, snakemake.output.md)
