from kvpool.engine import model
from kvpool.measure import logs

logs.to_log(snakemake.log[0])
model.build_model(snakemake.output[0], snakemake.params.spec, snakemake.params.device)
