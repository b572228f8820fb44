# Pool capacity (kvpool.studies.capacity): per shared lmcache-redis or memory-tier lmcache-mp cell and fraction
# in capacity.fractions, one unit on a fleet and a pool server of its own, limited to the fraction of the
# working set's KV bytes, then popularity-drawn follow-ups. A new fraction builds only its unit; --forcerun on a unit's unit.json
# re-measures it.


rule capacity_unit:
    """One shared cell at one capacity: populate, the server's cap, the warm-up and the measured window."""
    input:
        launch_input,
        prompts="results/workload/prompts.jsonl",
    output:
        plan=update(cell_path("capacity~{fraction}/plan.yaml")),
        manifest=update(cell_path("capacity~{fraction}/manifest.json")),
        csv=update(cell_path("capacity~{fraction}/requests.csv")),
        meta=update(cell_path("capacity~{fraction}/unit.json")),
        drive=update(cell_path("capacity~{fraction}/drive-samples.csv")),
        power=update(cell_path("capacity~{fraction}/power-samples.csv")),
    log:
        f"logs/capacity/{CELL_PATTERN}/capacity~{{fraction}}.log",
    benchmark:
        cell_path("benchmarks/capacity~{fraction}.tsv")
    wildcard_constraints:
        fraction=r"[0-9]+(\.[0-9]+)?",
    conda:
        CONDA_ENV
    resources:
        fleet=1,
    params:
        model=model_path(),
        settings=settings(capacity.run_capacity_unit),
        log_dir=lambda wc: f"logs/capacity/{Cell.from_wildcards(wc).name}/capacity~{wc.fraction}",
    script:
        "../scripts/run_capacity_unit.py"
