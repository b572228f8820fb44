from kvpool.cells import Cell
from kvpool.measure import logs, records
from kvpool.studies import routers

logs.to_log(snakemake.log[0])
# earlier outputs stay until this job has rewritten every one (its rule marks them update())
with records.measured_outputs(snakemake.output):
    # The manifest records the whole resolved config; only the declared settings re-measure the unit.
    routers.run_router_unit(snakemake.params.settings, Cell.from_wildcards(snakemake.wildcards),
                            snakemake.wildcards.router,
                            model=snakemake.params.model, prompts_path=snakemake.input.prompts,
                            plan_out=snakemake.output.plan, manifest_out=snakemake.output.manifest,
                            csv_out=snakemake.output.csv, json_out=snakemake.output.meta,
                            drive_csv=snakemake.output.drive,
                            power_csv=snakemake.output.power, log_dir=snakemake.params.log_dir,
                            provenance_config=snakemake.config, reference_csv=snakemake.input.reference or None)
