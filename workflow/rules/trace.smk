# A production trace replayed (kvpool.studies.trace_replay): per cell (its arm shared, isolated or off), router
# in trace.routers, one fleet on a fresh pool of the cell's kind replays the scaled trace one request at a time.
# A new router or arm builds only its units; --forcerun on a unit's run.json re-measures it.


rule trace_unit:
    """One cell under one router: its own plan and pool, one fleet, the trace replayed, the sample's reference,
    the unit's gate."""
    input:
        launch_input,
    output:
        plan=update(cell_path("trace~{router}/plan.yaml")),
        manifest=update(cell_path("trace~{router}/manifest.json")),
        csv=update(cell_path("trace~{router}/requests.csv")),
        meta=update(cell_path("trace~{router}/run.json")),
        reference=update(cell_path("trace~{router}/reference.csv")),
        drive=update(cell_path("trace~{router}/drive-samples.csv")),
        power=update(cell_path("trace~{router}/power-samples.csv")),
    log:
        f"logs/trace/{CELL_PATTERN}/trace~{{router}}.log",
    benchmark:
        cell_path("benchmarks/trace~{router}.tsv")
    wildcard_constraints:
        arm="shared|isolated|off",
        router="round-robin|random|prefix-affinity",
    conda:
        CONDA_ENV
    resources:
        fleet=1,
    params:
        model=model_path(),
        settings=settings(trace_replay.run_trace_unit),
        log_dir=lambda wc: f"logs/trace/{Cell.from_wildcards(wc).name}/trace~{wc.router}",
    script:
        "../scripts/run_trace_unit.py"
