# Load levels beyond the reuse phase (kvpool.studies.load): each cell's follow-ups at one closed-loop
# concurrency or open-loop rate, on the pool restored to what populate left (an MP memory pool,
# which cannot be restored, is populated again on fresh servers). Re-measure one level with
# --forcerun on its level.json; a new level in the config builds only that level. The last unit of
# the chain, with peer.enabled, is load~peer: vLLM's own client replaying the reuse phase (kvpool.studies.peer).


rule load_level:
    """One cell at one load level: restore the pool, a fresh fleet, drop and check, the follow-ups."""
    input:
        plan=cell_path("plan.yaml"),
        prompts="results/workload/prompts.jsonl",
        populate=cell_path("populate.csv"),
        populate_digests=cell_path("populate-digests.csv"),
        after=level_after,
        # the peer replay's gate compares its hits with what the reuse phase loaded
        reuse=lambda wc: (
            f"results/cells/{Cell.from_wildcards(wc).name}/reuse.csv" if wc.level.startswith("peer") else []
        ),
        # the split-matched recompute its answers are compared with (none for an external fleet without one)
        # (ordering only: a reference recomputed with more splits leaves a measured level as it is)
        reference=ancient("results/reference/outputs.csv") if external.needs_reference(config) else [],
    output:
        manifest=update(cell_path("load~{level}/manifest.json")),
        csv=update(cell_path("load~{level}/requests.csv")),
        meta=update(cell_path("load~{level}/level.json")),
        drive=update(cell_path("load~{level}/drive-samples.csv")),
        power=update(cell_path("load~{level}/power-samples.csv")),
    log:
        f"logs/load/{CELL_PATTERN}/load~{{level}}.log",
    benchmark:
        cell_path("benchmarks/load~{level}.tsv")
    conda:
        CONDA_ENV
    resources:
        fleet=1,
    params:
        settings=settings(load.run_load_level),
        remove_pool=lambda wc: not config["keep_pools"] and wc.level == cell_chain(Cell.from_wildcards(wc))[-1],
        log_dir=lambda wc: f"logs/load/{Cell.from_wildcards(wc).name}/load~{wc.level}",
    script:
        "../scripts/run_load_level.py"
