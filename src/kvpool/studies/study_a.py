"""Study A's cell: populate the pool, drop it from the page cache, reuse it cross-replica, and judge it;
the cell's plan, its recompute reference, its telemetry and the tier's ceiling. The phases' fleets and
requests are kvpool.studies.study_a_phases'."""

from __future__ import annotations

import logging
import shutil
from contextlib import nullcontext
from pathlib import Path

import pandas as pd

from kvpool.cells import Arm, Cell, pool_root, run_pools, tier_root
from kvpool.engine import external, owned, prompts
from kvpool.engine import pool_files as pool
from kvpool.engine.backends import pool_backend
from kvpool.engine.backends.base import BYTE_DIGESTS
from kvpool.engine.errors import LaunchRefused
from kvpool.engine.fleet import running_fleet, running_servers
from kvpool.engine.model import engine_pool_bytes_per_token, vocabulary
from kvpool.engine.plan import fleet_plan, placements, plan_gpus, plan_pool_dirs, reference_plan, server_port_count
from kvpool.engine.plan_types import Plan, read_plan, write_plan
from kvpool.measure import kvbytes, link, provenance, records, reference, validity
from kvpool.measure.drive import block_devices, sequential_read_ceiling
from kvpool.measure.files import read_frame_or_empty, read_json, write_json
from kvpool.measure.records import read_records
from kvpool.measure.reuse_checks import restore_pool
from kvpool.measure.timed import (
    drop_pool,
    phase_summary,
    pool_digests,
    reference_phase,
    refuse_failed_reference,
    server_settings,
    settled_stores,
)
from kvpool.measure.unit import UnitPaths, run_unit
from kvpool.measure.unit_plan import checked_ports, fresh_pool, new_plan, reference_replica
from kvpool.settings import (
    MEMORY_POOL_CELL_SETTINGS,
    PHASE_SETTINGS,
    backend_sections,
    external_fleet,
    pool_sections,
    reads,
)
from kvpool.studies.study_a_phases import populate_phase, reuse_phase

log = logging.getLogger(__name__)
# a pool of files restored between a document's follow-ups: its files stopped changing over this long first (a
# vllm-fs store reaches its file in two asynchronous hops after the answer)
RESTORE_POLL_S = 1.0


def _plan_sections(config: dict, wildcards) -> dict:
    """The sections only some cells' plans read: an external fleet's, and the pool servers' of their backend."""
    picked = external_fleet(config)
    picked.update(pool_sections(config, [pool_backend(wildcards.backend)]))
    return picked


@reads("replicas", "engine", "tiers", "hash_keys", "lmcache", "workload", "random_model", "min_pool_bytes",
       picked=_plan_sections)
def make_plan(config: dict, cell: Cell, model: str, plan_out: str, manifest_out: str,
              provenance_config: dict | None = None) -> None:
    """The cell's plan from ``config`` (the settings the plan rule declares) and its manifest, which
    records ``provenance_config`` (the whole resolved config; default ``config``)."""
    plan = new_plan(config, cell, model, Path(plan_out).parent)
    write_plan(plan, plan_out)
    cores = [r.core for r in plan.replicas if r.core is not None]
    notes = {"oversubscribed_cores": len(cores) != len(set(cores))}
    write_json(manifest_out, provenance.manifest(provenance_config or config, cell=cell.name, **notes))


# random_model: an MP server's L1 is sized from the model's KV bytes per token
@reads("replicas", "engine", "tiers", "hash_keys", "lmcache", "lmcache_mp", "lmcache_redis", "workload", "random_model",
       picked=backend_sections)
def check_launches(config: dict, cells: list[Cell], model: str, out: str) -> None:
    """Every cell's replica and pool-server launches, and the reference replica's, read by the programs that
    will run them (kvpool.engine.owned): a setting kvpool owns that the config's ``extra_args`` or ``env``
    changes stops the run here, before any fleet starts, with each problem named."""
    engine, count = config["engine"], config["replicas"]
    ports = engine["ports"] if isinstance(engine["ports"], list) else list(range(18100, 18100 + count))
    plans = [fleet_plan(config, cell, model, Path(out).parent.resolve(), ports, "launch check",
                        server_ports=list(range(18200, 18200 + server_port_count(cell, count))))
             for cell in cells]
    plans.append(reference_plan(config, model, ports[0], "launch check"))
    launches = [launch for plan in plans
                for launch in owned.launches(plan, engine["extra_args"], config["lmcache_mp"]["extra_args"])]
    if found := owned.problems(launches):
        raise LaunchRefused("a launch would run otherwise than kvpool plans it:\n  " + "\n  ".join(found))
    write_json(out, {"launches": [launch["name"] for launch in launches], "problems": [],
                     "versions": provenance.versions()})


def prepared(config: dict, cell: Cell, plan: Plan, servers=None) -> dict:
    """The cell's plan made ready before any fleet of it starts: its configured ports checked (a busy one
    fails here, before the cell's old pool is cleared) and its own pool folder emptied; an external fleet's
    pool is refused where it is used already."""
    if plan.external:
        _refuse_a_used_external_pool(plan)
        return plan
    plan = checked_ports(plan, servers)
    fresh_pool(pool_root(config, cell), plan)  # only this cell's own folder is ever removed
    return plan


@reads(*PHASE_SETTINGS)
def run_populate(config: dict, cell: Cell, *, plan_path: str, prompts_path: str, csv_out: str, json_out: str,
                 drive_csv: str, power_csv: str, digests_csv: str, log_dir: str, servers=None,
                 plan: Plan | None = None, replicas=None) -> None:
    """The populate phase; ``servers`` (and the ``plan`` they run) when a memory pool's servers run already,
    ``replicas`` when the cell's one fleet does (its plan prepared before it started: ``prepared``).

    Once the fleet has stopped (nothing more is stored), every pool file is hashed into ``digests_csv``:
    the validity gate checks that reuse read exactly these bytes.
    """
    plan = plan or read_plan(plan_path)
    if replicas is None:
        plan = prepared(config, cell, plan, servers)
    workload = prompts.read_workload(Path(prompts_path))
    probe = prompts.probe_prompts(vocabulary(plan.model), cell.chunk, config["workload"]["seed"])
    meta = run_unit(
        plan, lambda disks: populate_phase(plan, workload, config, probe, Path(log_dir), disks, servers,
                                           expect_shared=cell.arm == Arm.SHARED, replicas=replicas),
        UnitPaths(csv_out, json_out, drive_csv, power_csv, log_dir), "populate").meta
    dirs = plan_pool_dirs(plan)
    # before the pool is measured and hashed; a backend that stores after its answers gets every document's chunks
    # on top of what the preflight stored (none to wait for where kvpool sees no pool folder: an external fleet)
    settle = pool_backend(cell.backend).populate_settle(config, cell) if dirs else {}
    if "min_files" in settle:
        settle["min_files"] += meta["preflight"].get("chunks_before_documents", 0)
    meta["stores_settled"] = settled_stores(dirs, servers, **settle)
    if plan.memory_pool:  # no files: the pool is what the servers hold in memory
        held = sum(record["l1_bytes"] or 0 for record in meta["pool_server"].values())
        measure = pool_backend(cell.backend).pool_measure()
        meta["pool"] = {"files": 0, "bytes": int(held), "resident_bytes": None, "resident_fraction": None,
                        "source": f"{measure} of the pool's servers after populate"}
    else:
        meta["pool"] = pool.residency(dirs)
    readable_digests(dirs, servers, None, meta).to_csv(digests_csv, index=False)
    records.write_meta(meta, json_out)


def server_errors(*metas: dict) -> list[str] | None:
    """What the phases' pool-server records say went wrong (a server that died mid-phase, a pool that could
    not be read back), in phase order; None for a cell with no pool servers."""
    if not any("pool_server" in meta or "pool_digest_error" in meta for meta in metas):
        return None
    found = []
    for meta in metas:
        found += [record["error"] for record in meta.get("pool_server", {}).values() if record.get("error")]
        if meta.get("pool_digest_error"):
            found.append(f"the pool could not be read back: {meta['pool_digest_error']}")
    return found


def readable_digests(dirs, servers, stored: pd.DataFrame | None, meta: dict) -> pd.DataFrame:
    """The pool's digests (``pool_digests``); a pool server that died takes its pool with it, so its digests
    cannot be read: none then, and the cause in ``meta["pool_digest_error"]``, for the gate to name,
    instead of a crash that would lose the phase's records."""
    try:
        return pool_digests(dirs, servers, stored)
    except OSError as exc:
        meta["pool_digest_error"] = str(exc)
        log.error("the pool's chunks could not be read back (a pool server died?): %s", exc)
        return pd.DataFrame(columns=kvbytes.DIGEST_COLUMNS)


def _refuse_a_used_external_pool(plan: Plan) -> None:
    """An external fleet's pool is not kvpool's to clear: populate must find the directories it can see
    empty, or the reuse phase would count hits that an earlier run stored."""
    for directory in dict.fromkeys(plan_pool_dirs(plan)):
        if not directory.is_dir():
            raise RuntimeError(f"fleet.pool_dirs: {directory} is not a directory this machine can see")
        if files := pool.pool_files([directory]):
            raise RuntimeError(
                f"the external fleet's pool {directory} already holds {len(files)} files; kvpool never removes a pool "
                "it did not create, and a used pool would count an earlier run's chunks as hits: empty it (or start "
                f"the fleet on a new directory) and re-run {plan.cell} from its populate")


@reads("drop_caches", "fault_injection")
def run_drop(config: dict, plan_path: str, out: str) -> None:
    plan = read_plan(plan_path)
    injected = None
    if config["fault_injection"]["corrupt_stored_chunk"]:  # the self-test: reuse must not pass on this pool
        files = pool.pool_files(plan_pool_dirs(plan))
        if not files:
            raise RuntimeError(f"fault_injection.corrupt_stored_chunk: {plan.cell}'s pool holds no file to corrupt")
        injected = pool.corrupt(max(files, key=lambda p: p.stat().st_size))
        log.warning("fault injection: corrupted %s (%d bytes at %d)", injected["file"], injected["bytes"],
                    injected["offset"])
    record = drop_pool(plan, config["drop_caches"])
    if injected:
        record["fault_injection"] = injected
    write_json(out, record)
    log.info("pool: %d files, %d bytes, %d resident after the drop", record["files"], record["bytes"],
             record["resident_bytes"])


def prefill_replicas(populate_csv: str, workload: list[dict], cell: Cell) -> dict[int, int]:
    """Document -> the replica that prefilled it, as populate recorded; every document must have one."""
    populated = pd.read_csv(populate_csv)
    prefill = dict(zip(populated["doc_id"].astype(int), populated["prefill_replica"].astype(int), strict=True))
    missing = [item["doc_id"] for item in workload if item["doc_id"] not in prefill]
    if missing:
        raise RuntimeError(f"{populate_csv} has no prefill for documents {missing}; re-run populate for {cell.name}")
    return prefill


@reads(*PHASE_SETTINGS)
def run_reuse(config: dict, cell: Cell, *, plan_path: str, prompts_path: str, populate_csv: str,
              populate_digests: str, csv_out: str, json_out: str, drive_csv: str, power_csv: str, digests_csv: str,
              log_dir: str, servers=None, plan: Plan | None = None, remove_pool: bool | None = None,
              replicas=None) -> None:
    """The reuse phase; ``servers`` (and the ``plan`` they run) when a memory pool's servers run already,
    ``replicas`` when the cell's one fleet does.

    It measures only a pool exactly as populate left it: reuse adds chunks to a pool (follow-up
    chunks, and the isolated arm's recomputed documents), so a pool holding more files than populate
    hashed was warmed by an earlier reuse (a forced or interrupted one) and is refused.
    """
    plan = plan or read_plan(plan_path)
    workload = prompts.read_workload(Path(prompts_path))
    prefill = prefill_replicas(populate_csv, workload, cell)
    root, cell_dir = pool_root(config, cell), Path(csv_out).parent
    if not plan.external and not root.is_dir():
        raise RuntimeError(f"the pool of {cell.name} is gone ({root}; keep_pools is {config['keep_pools']}); "
                           f"re-run the cell from its populate: snakemake {cell_dir}/validity.json --forcerun populate")
    dirs = plan_pool_dirs(plan)
    stored = kvbytes.read_digests(populate_digests)
    found = len(pool.pool_files(dirs))
    if found > len(stored):
        raise RuntimeError(
            f"the pool of {cell.name} holds {found} files, {found - len(stored)} "
            f"more than populate left ({root}): an earlier reuse stored them, so this reuse would read a warm pool; "
            f"re-run the cell from its populate: snakemake {cell_dir}/validity.json --forcerun populate")
    drops, clears, held = [], [], []

    def restored_and_dropped() -> str:
        """A pool of files back to what populate stored (the last follow-up's stores removed) and out of
        the page cache again, so the next follow-up reloads it from the device. The stores land after the
        answer (vllm-fs's in two hops), so the files must stop changing first: a store landing after the
        restore would be found by the next follow-up (in the isolated arm, its ``isolation`` check fails)."""
        settled = settled_stores(dirs, None, poll_s=RESTORE_POLL_S)
        restored = restore_pool(dirs, stored)
        drops.append({**drop_pool(plan, config["drop_caches"]), "stores_settled": settled, "restored": restored})
        return ""

    def servers_emptied() -> str:
        """An isolated arm's pool servers emptied once the last follow-up's stores have landed: its serving
        replica stored the document it recomputed in its own server, which a later follow-up would find. No
        replica of the arm reads another's server, and none serves a document it prefilled, so nothing a
        follow-up could have used from them is lost; its ``isolation`` check still proves every one missed. What
        servers that can be read back (Redis) held is digested first, so the pool's digests keep every chunk."""
        settled = settled_stores([], servers)
        try:
            if all(hasattr(server, "digest_rows") for server in servers):
                held.append(pool_digests(dirs, servers, stored))
            clears.append({"stores_settled": settled, "servers": [server.clear() for server in servers]})
        except (OSError, ValueError) as exc:
            return f"the isolated arm's pool servers could not be emptied: {exc}"
        return ""

    between_reloads = None
    if not plan.memory_pool and not plan.external:
        between_reloads = restored_and_dropped
    elif plan.memory_pool and cell.arm == Arm.ISOLATED and servers:
        between_reloads = servers_emptied
    meta = run_unit(
        plan, lambda disks: reuse_phase(plan, workload, prefill, config, Path(log_dir), disks, servers,
                                        between_reloads, replicas=replicas),
        UnitPaths(csv_out, json_out, drive_csv, power_csv, log_dir), "reuse").meta
    if drops:
        meta["drops_between_reloads"] = drops
    if clears:
        meta["clears_between_reloads"] = clears
    # after the timed phase (hashing reads the whole pool), before a pool that is not kept goes; on the cell's
    # one fleet, once the follow-ups' own stores have landed (the replicas are still up)
    if replicas is not None:
        meta["stores_settled"] = settled_stores(dirs, servers)
    digests = readable_digests(dirs, servers, stored, meta)
    if held:  # servers emptied between reloads: each chunk as it was first read, before an emptying or now
        digests = pd.concat([*held, digests]).drop_duplicates(["copy", "key"], keep="first")
    digests.to_csv(digests_csv, index=False)
    log.info("pool digests: %d files, %d stored during reuse", len(digests),
             int((digests["stored_in"] == "reuse").sum()))
    # measured; the tier holds one cell's pool at a time (load levels remove it after the last level)
    remove_pool = not config["keep_pools"] if remove_pool is None else remove_pool
    remove_pool = remove_pool and not plan.external  # an external fleet's pool is never kvpool's
    if remove_pool:
        shutil.rmtree(root)
        log.info("removed the pool %s (keep_pools: false)", root)
    meta["pool_removed"] = remove_pool
    records.write_meta(meta, json_out)


def one_fleet(config: dict, cell: Cell) -> bool:
    """Whether ``cell`` runs populate, drop and reuse on one fleet (``run_cell``), as Study A ran a cell, or its
    backend needs a fresh fleet for the reuse (an lmcache-mp cell on a drive tier: an empty L1 must read the
    drive)."""
    return pool_backend(cell.backend).one_fleet(config, cell)


@reads(*MEMORY_POOL_CELL_SETTINGS)
def run_cell(config: dict, cell: Cell, plan_path: str, prompts_path: str, populate: dict, drop_out: str,
             reuse: dict, log_dirs: dict, remove_pool: bool | None = None) -> None:
    """Populate, drop and reuse of a cell on ONE fleet, as Study A ran a cell: its replicas (and the pool's
    servers, for a pool held in their memory, which lives exactly as long as they do) start once, the
    documents are prefilled, the pool is synced and dropped from the page cache, and every follow-up goes to a
    replica that never prefilled its document. That replica's own cache cannot hold a document it never saw,
    and each follow-up's local-cache-hit counter proves it (validity's own_cache_unused), so no fresh fleet
    is needed between the phases.

    ``populate`` and ``reuse`` map the phase's output names (csv, meta, drive, power, digests) to
    paths; ``log_dirs`` maps servers and replicas to log folders.
    """
    if not one_fleet(config, cell):
        raise ValueError(f"{cell.name} needs a fresh server and fleet for its reuse (one_fleet): run its populate, "
                         "drop and reuse rules")
    plan = read_plan(plan_path)
    servers_ready = running_servers(plan, Path(log_dirs["servers"]), server_settings(config, plan)[
        "startup_timeout_s"]) if plan.servers else nullcontext((plan, None))
    with servers_ready as (plan, servers):
        plan = prepared(config, cell, plan, servers)
        with running_fleet(plan, Path(log_dirs["replicas"]), config["engine"]["startup_timeout_s"]) as replicas:
            run_populate(config, cell, plan_path=plan_path, prompts_path=prompts_path, csv_out=populate["csv"],
                         json_out=populate["meta"], drive_csv=populate["drive"], power_csv=populate["power"],
                         digests_csv=populate["digests"], log_dir=log_dirs["replicas"], servers=servers, plan=plan,
                         replicas=replicas)
            run_drop(config, plan_path, drop_out)
            run_reuse(config, cell, plan_path=plan_path, prompts_path=prompts_path, populate_csv=populate["csv"],
                      populate_digests=populate["digests"], csv_out=reuse["csv"], json_out=reuse["meta"],
                      drive_csv=reuse["drive"], power_csv=reuse["power"], digests_csv=reuse["digests"],
                      log_dir=log_dirs["replicas"], servers=servers, plan=plan, remove_pool=remove_pool,
                      replicas=replicas)


@reads("engine", "workload", "hash_keys", "chunk_sizes")
def run_reference(config: dict, model: str, prompts_path: str, csv_out: str, log_dir: str) -> None:
    """Study A's split-matched reference: every follow-up in each split the workload's arithmetic
    predicts (kvpool.measure.reference.predicted_requests), on one replica with no pool. What it ran on goes to
    ``manifest.json`` beside ``csv_out``: a run carried to another machine (bench/device_resume.sh) holds its cells
    to a reference measured elsewhere."""
    requests = reference.predicted_requests(prompts.read_workload(Path(prompts_path)), config["chunk_sizes"])
    frame = reference_phase(reference_replica(config, model), requests, config, Path(log_dir))
    frame.to_csv(csv_out, index=False)
    records.write_meta(provenance.manifest(config, model=model), Path(csv_out).with_name("manifest.json"))
    refuse_failed_reference(frame)


def _validity_sections(config: dict, wildcards=None) -> dict:
    """The model length the replicas must have served (of ``engine``, nothing else), and ``fleet`` for an
    external fleet's cells."""
    return {"engine": {"max_model_len": config["engine"]["max_model_len"]}, **external_fleet(config)}


@reads("workload", "chunk_sizes", "min_pool_bytes", "min_hit_fraction", "max_resident_fraction",
       picked=_validity_sections)
def run_validity(config: dict, cell: Cell, *, populate_csv: str, populate_json: str, reuse_csv: str, reuse_json: str,
                 reference_csv: str | None, populate_digests: str | None, reuse_digests: str | None,
                 out: str) -> None:
    """The cell's gate; ``populate_digests``/``reuse_digests`` None only for records kept from runs that
    did not hash the pool at populate's end (the check is then absent, not passed); ``reference_csv``
    None where no recompute replica ran (an external fleet's, listed as not verified)."""
    populate_meta, reuse_meta = read_json(populate_json), read_json(reuse_json)
    unchanged, own_pool = None, populate_meta["pool"]
    if populate_digests is not None:
        stored = kvbytes.read_digests(populate_digests)
        own_pool = {**own_pool, "chunks": len(stored)}  # the files (a Redis pool's keys) read from the cell's own pool
        if reuse_digests is not None:
            unchanged = kvbytes.unchanged(stored, kvbytes.read_digests(reuse_digests))
    result = validity.evaluate(cell.arm, config, read_records(populate_csv), read_records(reuse_csv),
                               read_records(reference_csv) if reference_csv else None,
                               reuse_meta["drop_before_reuse"], populate_meta["pool"]["bytes"],
                               populate_meta["preflight"], chunk=cell.chunk,
                               write_errors=populate_meta.get("pool_write_errors", [])
                               + reuse_meta.get("pool_write_errors", []), pool_unchanged=unchanged,
                               not_verified=external.not_verified(config, cell.arm),
                               reload_drops=reuse_meta.get("drops_between_reloads", []),
                               server_errors=server_errors(populate_meta, reuse_meta),
                               served=[meta["served"] for meta in (populate_meta, reuse_meta) if "served" in meta],
                               own_pool=own_pool)
    write_json(out, {"cell": cell.name, **result})
    for reason in validity.failures(result):
        log.error("%s invalid: %s", cell.name, reason)


@reads("engine", "workload", "tiers", "lmcache_mp", picked=external_fleet)
def run_kv_bytes(config: dict, cells_run: list[Cell], digests_csvs: list[str], csv_out: str, md_out: str) -> None:
    """Compare each chunk's bytes across the arms' pools (see kvbytes); differences are logged."""
    digests = {(c.label, c.chunk, c.tier, c.arm): kvbytes.read_digests(path)
               for c, path in zip(cells_run, digests_csvs, strict=True)}
    # an MP memory pool is the server's L1: nothing of it is a file, so there are no bytes to hash (a
    # Redis pool's values are read from its servers and hashed like files)
    no_files = {(c.label, c.chunk, c.tier): why for c in cells_run
                if (why := pool_backend(c.backend).not_applicable(config, c).get(BYTE_DIGESTS)) is not None}
    no_files |= {(c.label, c.chunk, c.tier): external.not_verified(config, c.arm)["pool_unchanged"]
                 for c in cells_run if "pool_unchanged" in external.not_verified(config, c.arm)}
    table = kvbytes.kv_bytes_table(digests, config, no_files)
    table.to_csv(csv_out, index=False)
    Path(md_out).write_text(kvbytes.kv_bytes_markdown(table))
    bad = kvbytes.unexpected(table)
    tolerated = table[table["differ"] > 0].drop(index=bad.index)
    for row in bad.itertuples():
        log.error("KV bytes differ: %s/chunk %s/%s %s: %d of %d chunks (e.g. %s)", row.backend, row.chunk, row.tier,
                  row.comparison, row.differ, row.keys, row.example_key)
    for row in tolerated.itertuples():
        log.info("KV bytes differ: %s/chunk %s/%s %s: %d of %d chunks (e.g. %s); not expected to agree bit for bit: "
                 "%s", row.backend, row.chunk, row.tier, row.comparison, row.differ, row.keys, row.example_key,
                 kvbytes.not_required_why(row.meaning) or "another split of the work")
    for (backend, chunk, tier), _, found in kvbytes.findings(table):
        log.info("KV bytes, %s/chunk %s/%s: %s", backend, chunk, tier, found)


def run_telemetry(phase_files: dict, out_drive: str, out_power: str, out_summary: str, plan_path: str) -> None:
    """Merge a cell's per-phase samples into drive.csv / power.csv and summarize each phase.

    ``phase_files`` maps phase -> {"meta": json, "drive": csv, "power": csv, "records": csv}.
    Power counts the fleet's GPUs only (``plan_path``: the cell's plan), also in records of samplers
    that read every GPU of the host.
    """
    gpus = plan_gpus(read_plan(plan_path))
    drives, powers, summary = [], [], {}
    for phase, files in phase_files.items():
        drive, power, summary[phase] = phase_summary(
            read_frame_or_empty(files["drive"]), read_frame_or_empty(files["power"]),
            read_json(files["meta"])["telemetry"], len(read_records(files["records"])), gpus)
        drives.append(drive)
        powers.append(power)
    pd.concat(drives, ignore_index=True).to_csv(out_drive, index=False)
    pd.concat(powers, ignore_index=True).to_csv(out_power, index=False)
    write_json(out_summary, summary)


@reads("tiers", "drive_ceiling_bytes", "tier_rated_read_gbps", "engine", "replicas", "chunk_sizes", "random_model")
def run_ceiling(config: dict, tier: str, out: str) -> None:
    """The tier's sequential-read ceiling and, beside it, the host-to-GPU link's on the fleet's GPUs
    (kvpool.measure.link): what a drive tier's and a memory tier's reload are each held against."""
    root = tier_root(config, tier)
    mine = run_pools(config, tier) / "ceiling"
    others = lambda: sorted(str(p) for p in root.glob("kvpool-pools/*/ceiling/*.scratch")  # noqa: E731
                            if p.parent != mine)
    before = others()
    result = sequential_read_ceiling(mine, config["drive_ceiling_bytes"])
    result["rated_gb_per_s"] = config["tier_rated_read_gbps"].get(tier)
    result["devices"] = block_devices(root)
    # another run's ceiling on the same tier meanwhile shares the device: this figure is not its ceiling
    result["concurrent_ceilings"] = sorted(set(before) | set(others()))
    per_token = engine_pool_bytes_per_token(config)
    gpus = sorted({place["gpu"] for place in placements(config["engine"], config["replicas"], [0])} - {None})
    result["link"] = link.ceiling(gpus, [chunk * per_token for chunk in config["chunk_sizes"]] if per_token else [])
    write_json(out, result)
    log.info("tier %s: sequential read %.2f GB/s (%s)", tier, result["gb_per_s"], result["method"])
    found = result["link"]
    log.info("host-to-GPU link: %s", f"{found['gb_per_s']:.1f} GB/s pinned at 1 GiB on GPU(s) {found['gpus']}"
             if found["applicable"] else found["why"])
    if result["concurrent_ceilings"]:
        log.error("tier %s: another run measured this tier's ceiling at the same time (%s): its read rate is "
                  "shared, not this tier's ceiling; re-run the ceiling alone: snakemake %s --forcerun ceiling",
                  tier, ", ".join(result["concurrent_ceilings"]), out)
