from kvpool.measure import logs, model_check, records

logs.to_log(snakemake.log[0])
# an earlier check stays until this one has passed and rewritten it (its rule marks it update())
with records.measured_outputs(snakemake.output):
    model_check.run_model_check(snakemake.params.settings, snakemake.params.model, snakemake.output[0],
                                snakemake.params.log_dir)
