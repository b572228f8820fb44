from kvpool.cells import Cell
from kvpool.measure import logs
from kvpool.report import peer

logs.to_log(snakemake.log[0])
params = snakemake.params
units = [(Cell.from_name(name), unit) for name, unit in zip(params.cells, params.units, strict=True)]
inputs = snakemake.input
reuse = {cell: {"csv": csv, "validity": validity}
         for (cell, _), csv, validity in zip(units, inputs.reuse, inputs.validity, strict=True)}
replays = {unit: {"csv": csv, "meta": meta} for unit, csv, meta in zip(units, inputs.replays, inputs.meta, strict=True)}
peer.run_peer_table(units, reuse=reuse, replays=replays, csv_out=snakemake.output.csv, md_out=snakemake.output.md)
