from kvpool import logs, steps
from kvpool.cells import Cell

logs.to_log(snakemake.log[0])
cells = [Cell.from_name(name) for name in snakemake.params.cells]
steps.run_kv_bytes(snakemake.params.settings, cells, list(snakemake.input), snakemake.output.csv, snakemake.output.md)
