from kvpool.cells import Cell
from kvpool.measure import logs
from kvpool.studies import peer

logs.to_log(snakemake.log[0])
cells = [Cell.from_name(name) for name in snakemake.params.cells]
inputs = snakemake.input
reuse = {cell: {"csv": csv, "validity": validity}
         for cell, csv, validity in zip(cells, inputs.reuse, inputs.validity, strict=True)}
replays = {cell: {"csv": csv, "meta": meta} for cell, csv, meta in zip(cells, inputs.replays, inputs.meta, strict=True)}
peer.run_peer_table(cells, reuse=reuse, replays=replays, csv_out=snakemake.output.csv, md_out=snakemake.output.md)
