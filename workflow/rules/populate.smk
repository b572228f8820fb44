rule populate:
    """Start the fleet, check cross-replica key agreement, prefill each document once round robin."""
    input:
        plan=cell_path("plan.yaml"),
        prompts="results/workload/prompts.jsonl",
        pool_freed=pool_freed_first,
    output:
        csv=update(cell_path("populate.csv")),
        meta=update(cell_path("populate.json")),
        drive=update(cell_path("telemetry/populate-drive.csv")),
        power=update(cell_path("telemetry/populate-power.csv")),
        digests=update(cell_path("populate-digests.csv")),
    log:
        cell_log("populate"),
    benchmark:
        cell_path("benchmarks/populate.tsv")
    conda:
        CONDA_ENV
    resources:
        fleet=1,
    params:
        settings=settings(study_a.run_populate),
        log_dir=lambda wc: f"logs/populate/{Cell.from_wildcards(wc).name}/replicas",
    script:
        "../scripts/run_populate.py"
