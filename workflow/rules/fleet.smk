rule plan:
    """The resolved launch plan of one cell's fleet, and the provenance of the cell."""
    input:
        model_input,
    output:
        plan=cell_path("plan.yaml"),
        manifest=cell_path("manifest.json"),
    params:
        model=model_path(),
        # Declared so that a change to any of them re-plans (and so re-measures) the cell.
        fleet=lambda wc: {k: config[k] for k in ("replicas", "engine", "tiers", "hash_keys", "lmcache")
                          + (("lmcache_mp",) if wc.backend == mp.BACKEND else ())},
    conda:
        CONDA_ENV
    log:
        cell_log("plan"),
    script:
        "../scripts/make_plan.py"
