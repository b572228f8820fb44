rule validity:
    """The validity gate of one cell: errors, cross-replica routing, pool size, cold reads, hits, outputs."""
    input:
        # an external fleet measured without kvpool's recompute replica (fleet.reference: false) has none; with
        # measured_only, neither has a run that never made it (its cells' answers are then not verified)
        **({"reference": recorded("results/reference/outputs.csv")} if external.needs_reference(config) else {}),
        populate=cell_path("populate.csv"),
        populate_meta=cell_path("populate.json"),
        reuse=cell_path("reuse.csv"),
        reuse_meta=cell_path("reuse.json"),
        populate_digests=cell_recorded("populate-digests.csv"),
        reuse_digests=cell_recorded("pool-digests.csv"),
    output:
        cell_path("validity.json"),
    log:
        cell_log("validity"),
    conda:
        CONDA_ENV
    params:
        settings=settings(study_a.run_validity),
    script:
        "../scripts/run_validity.py"


rule validity_table:
    """Every cell's verdict, with the reasons of the invalid ones."""
    input:
        cell_files("validity.json"),
    output:
        "results/validity.csv",
    log:
        "logs/validity/table.log",
    conda:
        CONDA_ENV
    script:
        "../scripts/validity_table.py"


rule gate:
    """Fails the run, naming each invalid cell and each setting whose KV bytes differ where they must
    agree, and why; every measured file stays.

    It waits for the tables and the report, so a failing run still leaves the page that explains it.
    """
    input:
        # a run of capacity units alone has no cell: the gate judges its units
        validity="results/validity.csv" if CELLS else [],
        kv_bytes="results/kv_bytes.csv" if CELLS else [],
        load="results/load.csv" if CELLS else [],
        table1="results/table1.md" if CELLS else [],
        tiers=TIER_COMPARE if CELLS else [],
        report="results/report.html" if CELLS else [],
        studyb=STUDYB_TARGETS.get("validity", []),
        peer=PEER_TARGETS.get("csv", []),
        routers=ROUTER_TARGETS.get("csv", []),
        contexts=CONTEXT_TARGETS.get("csv", []),
        capacity=CAPACITY_TARGETS.get("csv", []),
        trace=TRACE_TARGETS.get("csv", []),
    output:
        "results/gate.ok",
    log:
        "logs/validity/gate.log",
    conda:
        CONDA_ENV
    script:
        "../scripts/gate.py"


rule kv_bytes:
    """Byte-level KV check: each stored chunk's digest in the shared pool against the isolated pools."""
    input:
        [f"results/cells/{cell.name}/pool-digests.csv" for cell in DIGESTED],
    output:
        csv="results/kv_bytes.csv",
        md="results/kv_bytes.md",
    log:
        "logs/validity/kv_bytes.log",
    conda:
        CONDA_ENV
    params:
        cells=cell_names(DIGESTED),
        settings=settings(study_a.run_kv_bytes),
    script:
        "../scripts/kv_bytes.py"
