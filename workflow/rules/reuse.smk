rule reuse:
    """Send every follow-up to a replica that did not prefill its document, reading the pool cold."""
    input:
        plan=cell_path("plan.yaml"),
        prompts="results/workload/prompts.jsonl",
        populate=cell_path("populate.csv"),
        populate_digests=cell_path("populate-digests.csv"),
        drop=cell_path("drop.json"),
    output:
        csv=update(cell_path("reuse.csv")),
        meta=update(cell_path("reuse.json")),
        drive=update(cell_path("telemetry/reuse-drive.csv")),
        power=update(cell_path("telemetry/reuse-power.csv")),
        digests=update(cell_path("pool-digests.csv")),
    log:
        cell_log("reuse"),
    benchmark:
        cell_path("benchmarks/reuse.tsv")
    conda:
        CONDA_ENV
    resources:
        fleet=1,
    params:
        settings=settings(study_a.run_reuse),
        log_dir=lambda wc: f"logs/reuse/{Cell.from_wildcards(wc).name}/replicas",
        # load levels restore and reuse the pool after this phase; the last of them removes it
        remove_pool=lambda wc: not config["keep_pools"] and not cell_chain(Cell.from_wildcards(wc)),
    script:
        "../scripts/run_reuse.py"
