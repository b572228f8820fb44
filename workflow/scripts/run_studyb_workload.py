from kvpool.measure import logs
from kvpool.studies import studyb

logs.to_log(snakemake.log[0])
studyb.run_studyb_workload(snakemake.params.settings, snakemake.params.study, snakemake.params.model,
                           snakemake.output[0])
