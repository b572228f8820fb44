from kvpool.cells import Cell
from kvpool.measure import logs, records
from kvpool.studies import load

logs.to_log(snakemake.log[0])
# earlier outputs stay until this job has rewritten every one (its rule marks them update())
with records.measured_outputs(snakemake.output):
    load.run_load_level(snakemake.params.settings, Cell.from_wildcards(snakemake.wildcards), snakemake.wildcards.level,
                        plan_path=snakemake.input.plan, prompts_path=snakemake.input.prompts,
                        populate_csv=snakemake.input.populate, populate_digests=snakemake.input.populate_digests,
                        csv_out=snakemake.output.csv, json_out=snakemake.output.meta, drive_csv=snakemake.output.drive,
                        power_csv=snakemake.output.power, log_dir=snakemake.params.log_dir,
                        remove_pool=snakemake.params.remove_pool,
                        reference_csv=snakemake.input.reference or None, manifest_out=snakemake.output.manifest,
                        provenance_config=snakemake.config)
