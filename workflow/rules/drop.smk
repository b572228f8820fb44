rule drop:
    """fsync and evict the pool from the page cache, then verify residency with mincore."""
    input:
        plan=cell_path("plan.yaml"),
        populate=cell_path("populate.csv"),
    output:
        update(cell_path("drop.json")),
    log:
        cell_log("drop"),
    conda:
        CONDA_ENV
    resources:
        fleet=1,
    params:
        settings=settings(study_a.run_drop),
    script:
        "../scripts/run_drop.py"
