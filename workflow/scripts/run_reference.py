from kvpool.measure import logs, records
from kvpool.studies import study_a

logs.to_log(snakemake.log[0])
# earlier outputs stay until this job has rewritten every one (its rule marks them update())
with records.measured_outputs(snakemake.output):
    study_a.run_reference(snakemake.params.settings, snakemake.params.model, snakemake.input.prompts,
                          snakemake.output[0], snakemake.params.log_dir)
