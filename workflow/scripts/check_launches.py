from kvpool.cells import Cell
from kvpool.measure import logs
from kvpool.studies import study_a

logs.to_log(snakemake.log[0])
study_a.check_launches(snakemake.params.settings, [Cell.from_name(name) for name in snakemake.params.cells],
                       snakemake.params.model, snakemake.output[0])
