# A memory pool (an lmcache-mp pool on a memory tier is the LMCache server's L1; an lmcache-redis pool
# is the Redis server's memory) lives only as long as its servers, so populate, drop and reuse of such
# a cell run in one job around one set of servers (each phase still starts a fresh fleet). Every other
# cell runs them as the three rules of populate.smk, drop.smk and reuse.smk. Re-run such a cell with
# --forcerun memory_pool_cell. The rule exists in every matrix (it matches no cell where none is a
# memory pool), so that --forcerun names it anywhere.
MEMORY_POOLS = sorted({(c.label, c.tier) for c in cells(config) if is_memory_pool(config, c)})
# The backend wildcard matches only where the same path's tier makes the pair a memory pool (a
# lookahead to the tier), so an lmcache-mp cell on a drive tier never falls to this rule.
MEMORY_POOL_BACKENDS = "|".join(
    f"{re.escape(backend)}(?=/arm~[^/]+/chunk~[^/]+/tier~{re.escape(tier)}/)" for backend, tier in MEMORY_POOLS
)


ruleorder: memory_pool_cell > populate
ruleorder: memory_pool_cell > drop
ruleorder: memory_pool_cell > reuse


rule memory_pool_cell:
    """Start the cell's pool servers, populate, check the drop, reuse, stop the servers."""
    input:
        plan=cell_path("plan.yaml"),
        prompts="results/workload/prompts.jsonl",
        pool_freed=pool_freed_first,
    output:
        populate_csv=cell_path("populate.csv"),
        populate_meta=cell_path("populate.json"),
        populate_drive=cell_path("telemetry/populate-drive.csv"),
        populate_power=cell_path("telemetry/populate-power.csv"),
        populate_digests=cell_path("populate-digests.csv"),
        drop=cell_path("drop.json"),
        reuse_csv=cell_path("reuse.csv"),
        reuse_meta=cell_path("reuse.json"),
        reuse_drive=cell_path("telemetry/reuse-drive.csv"),
        reuse_power=cell_path("telemetry/reuse-power.csv"),
        digests=cell_path("pool-digests.csv"),
    log:
        cell_log("memory_pool_cell"),
    benchmark:
        cell_path("benchmarks/memory_pool_cell.tsv")
    wildcard_constraints:
        backend=MEMORY_POOL_BACKENDS or "(?!)",  # (?!) matches nothing
    conda:
        CONDA_ENV
    resources:
        fleet=1,
    params:
        settings=settings(study_a.run_memory_pool_cell),
        log_dir=lambda wc: f"logs/memory_pool_cell/{Cell.from_wildcards(wc).name}",
    script:
        "../scripts/run_memory_pool_cell.py"
