from kvpool.cells import Cell
from kvpool.measure import logs, records
from kvpool.studies import study_a

logs.to_log(snakemake.log[0])
# earlier outputs stay until this job has rewritten every one (its rule marks them update())
with records.measured_outputs(snakemake.output):
    out = snakemake.output
    study_a.run_cell(
        snakemake.params.settings, Cell.from_wildcards(snakemake.wildcards), snakemake.input.plan,
        snakemake.input.prompts,
        populate={"csv": out.populate_csv, "meta": out.populate_meta, "drive": out.populate_drive,
                  "power": out.populate_power, "digests": out.populate_digests},
        drop_out=out.drop,
        reuse={"csv": out.reuse_csv, "meta": out.reuse_meta, "drive": out.reuse_drive, "power": out.reuse_power,
               "digests": out.digests},
        log_dirs={name: f"{snakemake.params.log_dir}/{name}" for name in ("servers", "replicas")},
        remove_pool=snakemake.params.remove_pool,
    )
