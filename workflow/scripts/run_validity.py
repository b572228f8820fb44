from kvpool import logs, steps
from kvpool.cells import Cell

logs.to_log(snakemake.log[0])
steps.run_validity(snakemake.config, Cell.from_wildcards(snakemake.wildcards), snakemake.input.populate,
                   snakemake.input.populate_meta, snakemake.input.reuse, snakemake.input.reuse_meta,
                   snakemake.input.reference, snakemake.output[0],
                   populate_digests=snakemake.input.populate_digests, reuse_digests=snakemake.input.reuse_digests)
