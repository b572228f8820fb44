from kvpool import logs, steps
from kvpool.cells import Cell

logs.to_log(snakemake.log[0])
steps.run_validity(snakemake.params.settings, Cell.from_wildcards(snakemake.wildcards),
                   populate_csv=snakemake.input.populate, populate_json=snakemake.input.populate_meta,
                   reuse_csv=snakemake.input.reuse, reuse_json=snakemake.input.reuse_meta,
                   reference_csv=snakemake.input.get("reference"),
                   populate_digests=snakemake.input.populate_digests or None,
                   reuse_digests=snakemake.input.reuse_digests or None, out=snakemake.output[0])
