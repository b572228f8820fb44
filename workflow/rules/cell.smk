# A cell's populate, drop and reuse run in one job on ONE fleet, as Study A ran a cell: the replicas stay up
# from the first document to the last follow-up, the pool is synced and dropped from the page cache between
# the steps, and every follow-up goes to a replica that never prefilled its document (its own cache is
# proven empty of it per follow-up by its counters). A pool held in servers' memory (an lmcache-mp L1 on a
# memory tier, Redis) lives exactly as long as they do, so they run around the fleet. The exception, an
# lmcache-mp cell on a drive tier, needs a fresh server (an empty L1) and so a fresh fleet for its reuse
# (kvpool.studies.study_a.one_fleet): it runs the rules of populate.smk, drop.smk and reuse.smk.
# Re-run a cell with --forcerun cell populate. The rule exists in every matrix (it matches no cell where
# none runs on one fleet), so that --forcerun names it anywhere.
ONE_FLEET = sorted({(c.label, c.tier) for c in cells(config) if study_a.one_fleet(config, c)})
# The backend wildcard matches only where the same path's tier makes the pair one fleet's (a lookahead to
# the tier), so an lmcache-mp cell on a drive tier never falls to this rule.
ONE_FLEET_BACKENDS = "|".join(
    f"{re.escape(backend)}(?=/arm~[^/]+/chunk~[^/]+/tier~{re.escape(tier)}/)" for backend, tier in ONE_FLEET
)


ruleorder: cell > populate
ruleorder: cell > drop
ruleorder: cell > reuse


rule cell:
    """Start the cell's pool servers and fleet once: populate, check the drop, reuse; stop them."""
    input:
        plan=cell_path("plan.yaml"),
        prompts="results/workload/prompts.jsonl",
        pool_freed=pool_freed_first,
    output:
        populate_csv=update(cell_path("populate.csv")),
        populate_meta=update(cell_path("populate.json")),
        populate_drive=update(cell_path("telemetry/populate-drive.csv")),
        populate_power=update(cell_path("telemetry/populate-power.csv")),
        populate_digests=update(cell_path("populate-digests.csv")),
        drop=update(cell_path("drop.json")),
        reuse_csv=update(cell_path("reuse.csv")),
        reuse_meta=update(cell_path("reuse.json")),
        reuse_drive=update(cell_path("telemetry/reuse-drive.csv")),
        reuse_power=update(cell_path("telemetry/reuse-power.csv")),
        digests=update(cell_path("pool-digests.csv")),
    log:
        cell_log("cell"),
    benchmark:
        cell_path("benchmarks/cell.tsv")
    wildcard_constraints:
        backend=ONE_FLEET_BACKENDS or "(?!)",  # (?!) matches nothing
    conda:
        CONDA_ENV
    resources:
        fleet=1,
    params:
        settings=settings(study_a.run_cell),
        log_dir=lambda wc: f"logs/cell/{Cell.from_wildcards(wc).name}",
        # load levels restore and reuse the pool after this phase; the last of them removes it
        remove_pool=lambda wc: not config["keep_pools"] and not cell_chain(Cell.from_wildcards(wc)),
    script:
        "../scripts/run_cell.py"
