from kvpool.cells import Cell
from kvpool.measure import logs
from kvpool.studies import study_a

logs.to_log(snakemake.log[0])
# The manifest records the whole resolved config as provenance (what else was set when this cell was
# measured); only the declared settings make the plan, so only they re-plan the cell when changed.
study_a.make_plan(snakemake.params.settings, Cell.from_wildcards(snakemake.wildcards), snakemake.params.model,
                  snakemake.output.plan, snakemake.output.manifest, provenance_config=snakemake.config)
