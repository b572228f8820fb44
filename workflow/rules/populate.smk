rule populate:
    """Start the fleet, check cross-replica key agreement, prefill each document once round robin."""
    input:
        plan=cell_path("plan.yaml"),
        prompts="results/workload/prompts.jsonl",
        pool_freed=pool_freed_first,
    output:
        csv=cell_path("populate.csv"),
        meta=cell_path("populate.json"),
        drive=cell_path("telemetry/populate-drive.csv"),
        power=cell_path("telemetry/populate-power.csv"),
        digests=cell_path("populate-digests.csv"),
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
