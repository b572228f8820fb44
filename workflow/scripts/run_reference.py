from kvpool.measure import logs
from kvpool.studies import study_a

logs.to_log(snakemake.log[0])
study_a.run_reference(snakemake.params.settings, snakemake.params.model, snakemake.input.prompts, snakemake.output[0],
                      snakemake.params.log_dir)
