from kvpool.cells import Cell
from kvpool.measure import logs
from kvpool.studies import capacity

logs.to_log(snakemake.log[0])
# The manifest records the whole resolved config; only the declared settings re-measure the unit.
capacity.run_capacity_unit(snakemake.params.settings, Cell.from_wildcards(snakemake.wildcards),
                           float(snakemake.wildcards.fraction), model=snakemake.params.model,
                           prompts_path=snakemake.input.prompts, plan_out=snakemake.output.plan,
                           manifest_out=snakemake.output.manifest, csv_out=snakemake.output.csv,
                           json_out=snakemake.output.meta, drive_csv=snakemake.output.drive,
                           power_csv=snakemake.output.power, log_dir=snakemake.params.log_dir,
                           provenance_config=snakemake.config)
