from kvpool.measure import logs, records
from kvpool.studies import studyb

logs.to_log(snakemake.log[0])
# earlier outputs stay until this job has rewritten every one (its rule marks them update())
with records.measured_outputs(snakemake.output):
    studyb.run_studyb_block(snakemake.params.settings, snakemake.params.study, snakemake.wildcards.block,
                            model=snakemake.params.model,
                            workload_path=snakemake.input.workload, plan_out=snakemake.output.plan,
                            manifest_out=snakemake.output.manifest, csv_out=snakemake.output.csv,
                            json_out=snakemake.output.meta, reference_out=snakemake.output.reference,
                            log_dir=snakemake.params.log_dir, known=list(snakemake.input.known),
                            provenance_config=snakemake.config)
