from kvpool.cells import Cell
from kvpool.measure import logs
from kvpool.studies import study_a

logs.to_log(snakemake.log[0])
study_a.run_populate(snakemake.params.settings, Cell.from_wildcards(snakemake.wildcards),
                     plan_path=snakemake.input.plan, prompts_path=snakemake.input.prompts,
                     csv_out=snakemake.output.csv, json_out=snakemake.output.meta,
                     drive_csv=snakemake.output.drive, power_csv=snakemake.output.power,
                     digests_csv=snakemake.output.digests, log_dir=snakemake.params.log_dir)
