rule plan:
    """The resolved launch plan of one cell's fleet, and the provenance of the cell."""
    input:
        model_input,
    output:
        plan=cell_path("plan.yaml"),
        manifest=cell_path("manifest.json"),
    log:
        cell_log("plan"),
    conda:
        CONDA_ENV
    params:
        model=model_path(),
        # A change to any of them re-plans (and so re-measures) the cell.
        settings=lambda wc: settings(
            "replicas",
            "engine",
            "tiers",
            "hash_keys",
            "lmcache",
            "workload",
            "random_model",
            "min_pool_bytes",
            # only an external fleet's plan reads it: a launched fleet's cells are not re-planned for it
            *(("fleet",) if external.is_external(config) else ()),
            *(("lmcache_mp",) if wc.backend == mp.BACKEND else ()),
            *(("lmcache_redis",) if wc.backend == redis_pool.BACKEND else ()),
        ),
    script:
        "../scripts/make_plan.py"
