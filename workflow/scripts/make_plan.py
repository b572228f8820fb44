from kvpool.cells import Cell
from kvpool.measure import logs, records
from kvpool.studies import study_a

logs.to_log(snakemake.log[0])
# the plan and manifest this job writes are kept in runs/ too, so a re-plan replaces nothing unkept
with records.measured_outputs(snakemake.output):
    # The manifest records the whole resolved config as provenance (what else was set when this cell was
    # measured); only the declared settings make the plan, so only they re-plan the cell when changed.
    study_a.make_plan(snakemake.params.settings, Cell.from_wildcards(snakemake.wildcards), snakemake.params.model,
                      snakemake.output.plan, snakemake.output.manifest, provenance_config=snakemake.config)
