from kvpool.cells import Cell
from kvpool.measure import logs, records
from kvpool.studies import study_a

logs.to_log(snakemake.log[0])
# earlier outputs stay until this job has rewritten every one (its rule marks them update())
with records.measured_outputs(snakemake.output):
    study_a.run_reuse(snakemake.params.settings, Cell.from_wildcards(snakemake.wildcards),
                      plan_path=snakemake.input.plan, prompts_path=snakemake.input.prompts,
                      populate_csv=snakemake.input.populate,
                      populate_digests=snakemake.input.populate_digests, csv_out=snakemake.output.csv,
                      json_out=snakemake.output.meta, drive_csv=snakemake.output.drive,
                      power_csv=snakemake.output.power,
                      digests_csv=snakemake.output.digests, log_dir=snakemake.params.log_dir,
                      remove_pool=snakemake.params.remove_pool)
