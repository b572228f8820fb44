# Routers compared (kvpool.studies.routers): per cell and router, one fleet on a fresh pool of the cell's kind
# sends each document's first request, every follow-up, a hot phase and, after one replica is
# stopped, every follow-up again, each request where the router sends it. A new router in
# routers.names builds only its units; --forcerun on a unit's run.json re-measures it.


rule router_unit:
    """One cell under one router: its own plan and pool, one fleet, the four phases, the unit's gate."""
    input:
        launch_input,
        prompts="results/workload/prompts.jsonl",
        # the split-matched recompute its follow-ups' answers are compared with
        # (ordering only: a reference recomputed with more splits leaves a measured unit as it is)
        reference=ancient("results/reference/outputs.csv") if external.needs_reference(config) else [],
    output:
        plan=update(cell_path("router~{router}/plan.yaml")),
        manifest=update(cell_path("router~{router}/manifest.json")),
        csv=update(cell_path("router~{router}/requests.csv")),
        meta=update(cell_path("router~{router}/run.json")),
        drive=update(cell_path("router~{router}/drive-samples.csv")),
        power=update(cell_path("router~{router}/power-samples.csv")),
    log:
        f"logs/routers/{CELL_PATTERN}/router~{{router}}.log",
    benchmark:
        cell_path("benchmarks/router~{router}.tsv")
    conda:
        CONDA_ENV
    resources:
        fleet=1,
    params:
        model=model_path(),
        settings=settings(routers.run_router_unit),
        log_dir=lambda wc: f"logs/routers/{Cell.from_wildcards(wc).name}/router~{wc.router}",
    script:
        "../scripts/run_router_unit.py"
