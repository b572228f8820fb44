from kvpool.cells import Cell
from kvpool.measure import logs
from kvpool.report import load

logs.to_log(snakemake.log[0])
cells = [Cell.from_name(name) for name in snakemake.params.cells]
inputs = snakemake.input
reuse = {cell: {"csv": csv, "meta": meta, "validity": validity, "telemetry": telemetry}
         for cell, csv, meta, validity, telemetry in zip(cells, inputs.reuse, inputs.reuse_meta, inputs.validity,
                                                         inputs.telemetry, strict=True)}
levels = {(Cell.from_name(name), level): {"csv": csv, "meta": meta}
          for (name, level), csv, meta in zip(snakemake.params.levels, inputs.levels, inputs.level_meta, strict=True)}
load.run_load_table(snakemake.params.settings, cells, reuse=reuse, levels=levels, csv_out=snakemake.output.csv,
                    md_out=snakemake.output.md, ceilings=list(inputs.ceilings))
