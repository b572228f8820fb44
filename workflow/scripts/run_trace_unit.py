from kvpool.cells import Cell
from kvpool.measure import logs, records
from kvpool.studies import trace_replay

logs.to_log(snakemake.log[0])
# earlier outputs stay until this job has rewritten every one (its rule marks them update())
with records.measured_outputs(snakemake.output):
    # The manifest records the whole resolved config; only the declared settings re-measure the unit.
    trace_replay.run_trace_unit(snakemake.params.settings, Cell.from_wildcards(snakemake.wildcards),
                                snakemake.wildcards.router, model=snakemake.params.model,
                                plan_out=snakemake.output.plan, manifest_out=snakemake.output.manifest,
                                csv_out=snakemake.output.csv, json_out=snakemake.output.meta,
                                reference_out=snakemake.output.reference, drive_csv=snakemake.output.drive,
                                power_csv=snakemake.output.power, log_dir=snakemake.params.log_dir,
                                provenance_config=snakemake.config)
