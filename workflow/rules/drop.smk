rule drop:
    """fsync and evict the pool from the page cache, then verify residency with mincore."""
    input:
        plan=cell_path("plan.yaml"),
        populate=cell_path("populate.csv"),
    output:
        cell_path("drop.json"),
    resources:
        fleet=1,
    conda:
        CONDA_ENV
    log:
        cell_log("drop"),
    script:
        "../scripts/run_drop.py"
