from kvpool.cells import Cell
from kvpool.measure import logs
from kvpool.studies import study_a

logs.to_log(snakemake.log[0])
study_a.run_validity(snakemake.params.settings, Cell.from_wildcards(snakemake.wildcards),
                     populate_csv=snakemake.input.populate, populate_json=snakemake.input.populate_meta,
                     reuse_csv=snakemake.input.reuse, reuse_json=snakemake.input.reuse_meta,
                     reference_csv=snakemake.input.get("reference"),
                     populate_digests=snakemake.input.populate_digests or None,
                     reuse_digests=snakemake.input.reuse_digests or None, out=snakemake.output[0])
