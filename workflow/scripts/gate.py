from kvpool import logs, steps

logs.to_log(snakemake.log[0])
steps.gate(snakemake.input[0], snakemake.output[0])
