from kvpool.measure import logs
from kvpool.studies import studyb

logs.to_log(snakemake.log[0])
studyb.run_studyb_block(snakemake.params.settings, snakemake.params.study, snakemake.wildcards.block,
                        model=snakemake.params.model,
                        workload_path=snakemake.input.workload, plan_out=snakemake.output.plan,
                        manifest_out=snakemake.output.manifest, csv_out=snakemake.output.csv,
                        json_out=snakemake.output.meta, reference_out=snakemake.output.reference,
                        log_dir=snakemake.params.log_dir, known=list(snakemake.input.known),
                        provenance_config=snakemake.config)
