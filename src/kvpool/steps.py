"""One function per pipeline step: read the step's inputs, do the work, write its outputs.

Every timed phase also keeps a timestamped copy of its raw records under the cell's ``runs/``
folder, which Snakemake never deletes, so a forced re-run cannot lose an earlier measurement.
"""

from __future__ import annotations

import contextlib
import html
import logging
import os
import shutil
import time
from pathlib import Path

import pandas as pd
import yaml

from kvpool import external, kvbytes, logs, mp, phases, pool, prompts, provenance, redis_pool, summary, validity
from kvpool.cells import Cell, is_memory_pool, pool_root, run_pools
from kvpool.files import read_frame_or_empty, read_json, read_records, write_json
from kvpool.fleet import free_ports, resolve_ports, resolve_server_ports, running_servers
from kvpool.plan import external_plan, fleet_plan, plan_gpus, plan_pool_dirs, reference_plan, server_port_count
from kvpool.telemetry import energy_mean_power

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]


def _archive(frame: pd.DataFrame, out_csv: Path, phase: str) -> None:
    runs = Path(out_csv).parent / "runs"
    runs.mkdir(exist_ok=True)
    frame.to_csv(runs / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{phase}.csv", index=False)


def build_model(out_dir: str, spec: dict, device: str) -> None:
    from kvpool.model import build_random_model

    summary_ = build_random_model(Path(out_dir), spec, device=device)
    log.info("built a random-weights model: %s parameters, %s KV bytes per token",
             summary_["parameters"], summary_["kv_bytes_per_token"])


def vocabulary(model: str) -> list[int]:
    """Token ids a document may use: the tokenizer's vocabulary less its special tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def make_prompts(model: str, workload_cfg: dict, out: str) -> None:
    items = prompts.make_workload(vocabulary(model), workload_cfg["documents"], workload_cfg["doc_tokens"],
                                  workload_cfg["followup_tokens"], workload_cfg["seed"],
                                  workload_cfg["followups_per_document"])
    prompts.write_workload(Path(out), items)
    log.info("wrote %d documents of %d tokens", len(items), workload_cfg["doc_tokens"])


def _ports(config: dict, count: int) -> tuple[list[int], str]:
    ports = config["engine"]["ports"]
    if ports == "auto":
        return free_ports(config["engine"]["host"], count), "auto"
    return list(ports[:count]), "config"


def _new_plan(config: dict, cell: Cell, model: str, cell_dir: Path, pool_root: Path | None = None) -> dict:
    """``cell``'s fleet plan on free (or configured) ports; an lmcache-mp cell's servers get a ZMQ and an
    HTTP port each, clear of the replicas' (one server shared, one per replica isolated, none off).
    An external fleet's plan is its endpoints."""
    if external.is_external(config):
        return external_plan(config, cell, model)
    ports, source = _ports(config, config["replicas"])
    server_ports = None
    if count := server_port_count(cell, config["replicas"]):
        server_ports = free_ports(config["engine"]["host"], count, exclude=ports)
    return fleet_plan(config, cell, model, Path(cell_dir).resolve(), ports, source, server_ports=server_ports,
                      pool_root=pool_root)


def make_plan(config: dict, cell: Cell, model: str, plan_out: str, manifest_out: str,
              provenance_config: dict | None = None) -> None:
    """The cell's plan from ``config`` (the settings the plan rule declares) and its manifest, which
    records ``provenance_config`` (the whole resolved config; default ``config``)."""
    plan = _new_plan(config, cell, model, Path(plan_out).parent)
    Path(plan_out).write_text(yaml.safe_dump(plan, sort_keys=False, width=200))
    cores = [r["core"] for r in plan["replicas"] if r["core"] is not None]
    notes = {"oversubscribed_cores": len(cores) != len(set(cores))}
    write_json(manifest_out, provenance.manifest(provenance_config or config, REPO, cell=cell.name, **notes))


def checked_ports(plan: dict, servers=None) -> dict:
    """The plan with its replicas' ports, and its servers' unless they run already (``servers``: a memory
    pool's, whose ports are theirs, not taken), checked free; taken auto ports move."""
    plan = resolve_ports(plan)
    return plan if servers else resolve_server_ports(plan)


def run_populate(config: dict, cell: Cell, *, plan_path: str, prompts_path: str, csv_out: str, json_out: str,
                 drive_csv: str, power_csv: str, digests_csv: str, log_dir: str, servers=None,
                 plan: dict | None = None) -> None:
    """The populate phase; ``servers`` (and the ``plan`` they run) when a memory pool's servers run already.

    Once the fleet has stopped (nothing more is stored), every pool file is hashed into ``digests_csv``:
    the validity gate checks that reuse read exactly these bytes.
    """
    plan = plan or yaml.safe_load(Path(plan_path).read_text())
    if plan.get("external"):
        _refuse_a_used_external_pool(plan)
    else:
        # a configured port that is busy fails here, before the cell's old pool is cleared
        plan = checked_ports(plan, servers)
        _fresh_pool(pool_root(config, cell), plan)  # only this cell's own folder is ever removed
    workload = prompts.read_workload(Path(prompts_path))
    probe = prompts.probe_prompts(vocabulary(plan["model"]), cell.chunk, config["workload"]["seed"])
    frame, meta = _run_sampled_phase(
        plan,
        lambda disks: phases.populate(plan, workload, config, probe, Path(log_dir), disks, servers,
                                      expect_shared=cell.arm == "shared"),
        drive_csv, power_csv, log_dir)
    _archive(frame, Path(csv_out), "populate")
    frame.to_csv(csv_out, index=False)
    dirs = plan_pool_dirs(plan)
    if plan.get("memory_pool"):  # no files: the pool is what the servers hold in memory
        held = sum(record["l1_bytes"] or 0 for record in meta["pool_server"].values())
        measure = redis_pool.POOL_BYTES if cell.backend == redis_pool.BACKEND else mp.L1_BYTES
        meta["pool"] = {"files": 0, "bytes": int(held), "resident_bytes": None, "resident_fraction": None,
                        "source": f"{measure} of the pool's servers after populate"}
    else:
        meta["pool"] = pool.residency(dirs)
    _pool_digests(dirs, servers).to_csv(digests_csv, index=False)
    write_json(json_out, meta)


def _refuse_a_used_external_pool(plan: dict) -> None:
    """An external fleet's pool is not kvpool's to clear: populate must find the directories it can see
    empty, or the reuse phase would count hits that an earlier run stored."""
    for directory in dict.fromkeys(plan_pool_dirs(plan)):
        if not directory.is_dir():
            raise RuntimeError(f"fleet.pool_dirs: {directory} is not a directory this machine can see")
        if files := pool.pool_files([directory]):
            raise RuntimeError(
                f"the external fleet's pool {directory} already holds {len(files)} files; kvpool never removes a pool "
                "it did not create, and a used pool would count an earlier run's chunks as hits: empty it (or start "
                f"the fleet on a new directory) and re-run {plan['cell']} from its populate")


def _fresh_pool(root: Path, plan: dict) -> None:
    """Empty ``root`` (a cell's, a Study B block's or a router unit's own pool folder) and create the
    plan's pool directories in it."""
    if root.exists():
        shutil.rmtree(root)
    for directory in set(plan_pool_dirs(plan)):
        directory.mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def _unit_pool(config: dict, root: Path, plan: dict):
    """A unit's own pool (a Study B block's, a length unit's, a router unit's): emptied before its fleet
    starts and removed when the unit ends, however it ends (unless keep_pools), so a failed unit leaves
    nothing on the tier that the space check does not expect."""
    _fresh_pool(root, plan)
    try:
        yield root
    finally:
        if not config["keep_pools"]:
            shutil.rmtree(root, ignore_errors=True)


def _pool_digests(dirs: list[Path], servers=None, populate: pd.DataFrame | None = None) -> pd.DataFrame:
    """The pool's chunks digested: a Redis pool's values from its servers, else the pool's files (an MP
    memory pool has none: its L1 cannot be read from outside)."""
    if servers and all(hasattr(server, "digest_rows") for server in servers):
        return kvbytes.with_stored_in([row for server in servers for row in server.digest_rows()], populate)
    return kvbytes.pool_digests(dirs, populate)


def run_drop(config: dict, plan_path: str, out: str) -> None:
    plan = yaml.safe_load(Path(plan_path).read_text())
    injected = None
    if config["fault_injection"]["corrupt_stored_chunk"]:  # the self-test: reuse must not pass on this pool
        files = pool.pool_files(plan_pool_dirs(plan))
        if not files:
            raise RuntimeError(f"fault_injection.corrupt_stored_chunk: {plan['cell']}'s pool holds no file to corrupt")
        injected = pool.corrupt(max(files, key=lambda p: p.stat().st_size))
        log.warning("fault injection: corrupted %s (%d bytes at %d)", injected["file"], injected["bytes"],
                    injected["offset"])
    record = phases.drop_pool(plan, config["drop_caches"])
    if injected:
        record["fault_injection"] = injected
    write_json(out, record)
    log.info("pool: %d files, %d bytes, %d resident after the drop", record["files"], record["bytes"],
             record["resident_bytes"])


def _prefills(populate_csv: str, workload: list[dict], cell: Cell) -> dict[int, int]:
    """Document -> the replica that prefilled it, as populate recorded; every document must have one."""
    populated = pd.read_csv(populate_csv)
    prefill = dict(zip(populated["doc_id"].astype(int), populated["prefill_replica"].astype(int), strict=True))
    missing = [item["doc_id"] for item in workload if item["doc_id"] not in prefill]
    if missing:
        raise RuntimeError(f"{populate_csv} has no prefill for documents {missing}; re-run populate for {cell.name}")
    return prefill


def run_reuse(config: dict, cell: Cell, *, plan_path: str, prompts_path: str, populate_csv: str,
              populate_digests: str, csv_out: str, json_out: str, drive_csv: str, power_csv: str, digests_csv: str,
              log_dir: str, servers=None, plan: dict | None = None, remove_pool: bool | None = None) -> None:
    """The reuse phase; ``servers`` (and the ``plan`` they run) when a memory pool's servers run already.

    It measures only a pool exactly as populate left it: reuse adds chunks to a pool (follow-up
    chunks, and the isolated arm's recomputed documents), so a pool holding more files than populate
    hashed was warmed by an earlier reuse (a forced or interrupted one) and is refused.
    """
    plan = plan or yaml.safe_load(Path(plan_path).read_text())
    workload = prompts.read_workload(Path(prompts_path))
    prefill = _prefills(populate_csv, workload, cell)
    root, cell_dir = pool_root(config, cell), Path(csv_out).parent
    if not plan.get("external") and not root.is_dir():
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
    drops = []

    def between_reloads() -> None:
        """A pool of files back to what populate stored (the last follow-up's stores removed) and out of
        the page cache again, so the next follow-up reloads it from the device."""
        from kvpool.load import restore_pool

        restore_pool(dirs, stored)
        drops.append(phases.drop_pool(plan, config["drop_caches"]))

    files = not plan.get("memory_pool") and not plan.get("external")
    frame, meta = _run_sampled_phase(
        plan, lambda disks: phases.reuse(plan, workload, prefill, config, Path(log_dir), disks, servers,
                                         between_reloads if files else None),
        drive_csv, power_csv, log_dir)
    if drops:
        meta["drops_between_reloads"] = drops
    _archive(frame, Path(csv_out), "reuse")
    frame.to_csv(csv_out, index=False)
    # after the timed phase (hashing reads the whole pool), before a pool that is not kept goes
    digests = _pool_digests(dirs, servers, stored)
    digests.to_csv(digests_csv, index=False)
    log.info("pool digests: %d files, %d stored during reuse", len(digests),
             int((digests["stored_in"] == "reuse").sum()))
    # measured; the tier holds one cell's pool at a time (load levels remove it after the last level)
    remove_pool = not config["keep_pools"] if remove_pool is None else remove_pool
    remove_pool = remove_pool and not plan.get("external")  # an external fleet's pool is never kvpool's
    if remove_pool:
        shutil.rmtree(root)
        log.info("removed the pool %s (keep_pools: false)", root)
    meta["pool_removed"] = remove_pool
    write_json(json_out, meta)


def run_memory_pool_cell(config: dict, cell: Cell, plan_path: str, prompts_path: str, populate: dict, drop_out: str,
                         reuse: dict, log_dirs: dict) -> None:
    """Populate, drop and reuse of an lmcache-mp cell on a memory tier, around one set of servers: the
    pool is their L1, so it lives exactly as long as they do. Each phase still starts its own fleet.

    ``populate`` and ``reuse`` map the phase's output names (csv, meta, drive, power, digests) to
    paths; ``log_dirs`` maps populate, reuse and servers to log folders.
    """
    plan = yaml.safe_load(Path(plan_path).read_text())
    timeout_s = phases.server_settings(config, plan)["startup_timeout_s"]
    with running_servers(plan, Path(log_dirs["servers"]), timeout_s) as (plan, servers):
        run_populate(config, cell, plan_path=plan_path, prompts_path=prompts_path, csv_out=populate["csv"],
                     json_out=populate["meta"], drive_csv=populate["drive"], power_csv=populate["power"],
                     digests_csv=populate["digests"], log_dir=log_dirs["populate"], servers=servers, plan=plan)
        run_drop(config, plan_path, drop_out)
        run_reuse(config, cell, plan_path=plan_path, prompts_path=prompts_path, populate_csv=populate["csv"],
                  populate_digests=populate["digests"], csv_out=reuse["csv"], json_out=reuse["meta"],
                  drive_csv=reuse["drive"], power_csv=reuse["power"], digests_csv=reuse["digests"],
                  log_dir=log_dirs["reuse"], servers=servers, plan=plan)


def run_reference(config: dict, model: str, prompts_path: str, csv_out: str, log_dir: str) -> None:
    """Study A's split-matched reference: every follow-up in each split the workload's arithmetic
    predicts (kvpool.reference.predicted_requests), on one replica with no pool."""
    from kvpool import reference

    requests = reference.predicted_requests(prompts.read_workload(Path(prompts_path)), config["chunk_sizes"])
    frame = phases.reference(reference_replica(config, model), requests, config, Path(log_dir))
    frame.to_csv(csv_out, index=False)
    _refuse_failed_reference(frame)


def _refuse_failed_reference(frame: pd.DataFrame) -> None:
    """A reference that could not compute every request would leave answers unverified: stop, naming why."""
    failed = frame[frame["error"].fillna("") != ""]
    if len(failed):
        for row in failed.head(5).itertuples():
            log.error("reference request %s, split %s, failed: %s", row.key, row.requested_split, row.error)
        raise RuntimeError(f"{len(failed)} of {len(frame)} reference requests failed, e.g. {failed['key'].iloc[0]} "
                           f"split {failed['requested_split'].iloc[0]}: {failed['error'].iloc[0]}")


def reference_replica(config: dict, model: str) -> dict:
    """The plan of one replica with no pool, on a free (or the first configured) port."""
    ports, source = _ports(config, 1)
    return checked_ports(reference_plan(config, model, ports[0], source))


def run_validity(config: dict, cell: Cell, *, populate_csv: str, populate_json: str, reuse_csv: str, reuse_json: str,
                 reference_csv: str | None, populate_digests: str | None, reuse_digests: str | None,
                 out: str) -> None:
    """The cell's gate; ``populate_digests``/``reuse_digests`` None only for records kept from runs that
    did not hash the pool at populate's end (the check is then absent, not passed); ``reference_csv``
    None where no recompute replica ran (an external fleet's, listed as not verified)."""
    populate_meta, reuse_meta = read_json(populate_json), read_json(reuse_json)
    unchanged = None
    if populate_digests is not None and reuse_digests is not None:
        unchanged = kvbytes.unchanged(kvbytes.read_digests(populate_digests), kvbytes.read_digests(reuse_digests))
    result = validity.evaluate(cell.arm, config, read_records(populate_csv), read_records(reuse_csv),
                               read_records(reference_csv) if reference_csv else None,
                               reuse_meta["drop_before_reuse"], populate_meta["pool"]["bytes"],
                               populate_meta["preflight"], chunk=cell.chunk,
                               write_errors=populate_meta.get("pool_write_errors", [])
                               + reuse_meta.get("pool_write_errors", []), pool_unchanged=unchanged,
                               not_verified=external.not_verified(config, cell.arm),
                               reload_drops=reuse_meta.get("drops_between_reloads", []))
    write_json(out, {"cell": cell.name, **result})
    for reason in validity.failures(result):
        log.error("%s invalid: %s", cell.name, reason)


def run_summary(config: dict, cells: list[Cell], reuse_csvs: list[str], reuse_jsons: list[str],
                validity_jsons: list[str], telemetry_jsons: list[str], *, cells_csv: str, csv_out: str,
                md_out: str) -> None:
    """The per-cell table (``cells_csv``: every figure of every cell, with its intervals) and Study A's
    Table 1 drawn from it."""
    records = {cell.name: read_records(path) for cell, path in zip(cells, reuse_csvs, strict=True)}
    rows = [summary.cell_row(cell, records[cell.name], read_json(reuse_json)["wall_s"],
                             _phase_power(read_json(telemetry_json)["reuse"]), read_json(validity_json), config)
            for cell, reuse_json, validity_json, telemetry_json in zip(
                cells, reuse_jsons, validity_jsons, telemetry_jsons, strict=True)]
    per_cell = pd.DataFrame(rows)
    per_cell.to_csv(cells_csv, index=False)
    ttft = {name: frame.loc[frame["error"].fillna("") == "", "ttft_s"].to_numpy(dtype=float)
            for name, frame in records.items()}
    table = summary.table1(per_cell, ttft)
    table.to_csv(csv_out, index=False)
    Path(md_out).write_text("# Table 1: cross-replica follow-ups, isolated pools against a shared pool\n\n"
                            + summary.table1_markdown(table))


def _phase_power(phase: dict) -> dict:
    """A phase summary's power, its mean from the energy counter over the phase (kvpool.telemetry)."""
    return energy_mean_power(phase["power"], phase.get("duration_s"))


def run_kv_bytes(config: dict, cells_run: list[Cell], digests_csvs: list[str], csv_out: str, md_out: str) -> None:
    """Compare each chunk's bytes across the arms' pools (see kvbytes); differences are logged."""
    digests = {(c.backend, c.chunk, c.tier, c.arm): kvbytes.read_digests(path)
               for c, path in zip(cells_run, digests_csvs, strict=True)}
    # an MP memory pool is the server's L1: nothing of it is a file, so there are no bytes to hash (a
    # Redis pool's values are read from its servers and hashed like files)
    no_files = {(c.backend, c.chunk, c.tier): "the pool is the LMCache MP server's L1 (host RAM), which writes no "
                "files; the greedy outputs against the recompute (output_matches_recompute) check its KV instead"
                for c in cells_run if is_memory_pool(config, c) and c.backend == mp.BACKEND}
    no_files |= {(c.backend, c.chunk, c.tier): external.not_verified(config, c.arm)["pool_unchanged"]
                 for c in cells_run if "pool_unchanged" in external.not_verified(config, c.arm)}
    table = kvbytes.kv_bytes_table(digests, config, no_files)
    table.to_csv(csv_out, index=False)
    Path(md_out).write_text(kvbytes.kv_bytes_markdown(table))
    bad = kvbytes.unexpected(table)
    tolerated = table[table["differ"] > 0].drop(index=bad.index)
    tolerated_why = "; not expected to agree bit for bit (the document is not whole chunks)"
    for rows, report, why in ((bad, log.error, ""), (tolerated, log.info, tolerated_why)):
        for row in rows.itertuples():
            report("KV bytes differ: %s/chunk %s/%s %s: %d of %d chunks (e.g. %s)%s", row.backend, row.chunk,
                   row.tier, row.comparison, row.differ, row.keys, row.example_key, why)
    for (backend, chunk, tier), _, found in kvbytes.findings(table):
        log.info("KV bytes, %s/chunk %s/%s: %s", backend, chunk, tier, found)


def run_validity_table(validity_jsons: list[str], out: str) -> None:
    """results/validity.csv: each cell's verdict, the checks it rests on (passed, failed), the reasons of a
    failure, and the checks that were not applicable or not verified, by name."""
    from kvpool.checks import NOT_APPLICABLE, NOT_VERIFIED, status, tally

    rows = []
    for path in validity_jsons:
        record = read_json(path)

        named = {wanted: [name for name, check in record["checks"].items() if status(check) == wanted]
                 for wanted in (NOT_APPLICABLE, NOT_VERIFIED)}
        counts = tally(record["checks"])
        rows.append({"cell": record["cell"], "valid": record["valid"], "checks_passed": counts["passed"],
                     "checks_failed": counts["failed"], "reasons": "; ".join(validity.failures(record)),
                     # records from before statuses kept an external fleet's unverified checks apart
                     "not_verified": "; ".join([*record.get("not_verified", {}), *named[NOT_VERIFIED]]),
                     "not_applicable": "; ".join(named[NOT_APPLICABLE])})
    pd.DataFrame(rows, columns=VALIDITY_COLUMNS).to_csv(out, index=False)


VALIDITY_COLUMNS = ["cell", "valid", "checks_passed", "checks_failed", "reasons", "not_verified", "not_applicable"]


def gate(validity_csv: str, kv_bytes_csv: str, out: str, load_csv: str | None = None,
         studyb_json: str | None = None, peer_csv: str | None = None, routers_csv: str | None = None,
         contexts_csv: str | None = None) -> None:
    """Fail, naming every invalid cell and every setting whose pools hold chunks that differ where they
    must agree bit for bit, and why; the measured data stays where it is."""
    table = pd.read_csv(validity_csv, keep_default_na=False)
    invalid = table[~table["valid"].astype(bool)]
    damaged = kvbytes.unexpected(pd.read_csv(kv_bytes_csv, keep_default_na=False))
    lines = [f"  {row.cell}: {row.reasons}" for row in invalid.itertuples()]
    counted = []  # the units beyond the cells that the verdict also rests on, for the gate's line
    if load_csv is not None:  # the load levels beyond reuse (c1 is the cell's own gate, above)
        levels = pd.read_csv(load_csv)
        beyond = levels[levels["level"] != "c1"] if len(levels) else levels
        if len(beyond):
            unverified = int((beyond.get("outputs_checked", pd.Series(dtype=str)) == "not_verified").sum())
            counted.append(f"{len(beyond)} load levels ({unverified} with answers not verified)")
        bad_levels = beyond[~beyond["valid"].astype(bool)] if len(beyond) else beyond
        lines += [f"  {row.cell} load~{row.level}: its level.json names the failed checks"
                  for row in bad_levels.itertuples()]
        invalid = pd.concat([invalid, bad_levels[["cell"]]]) if len(bad_levels) else invalid
    if peer_csv is not None:  # vLLM's replay of a cell: an invalid one measured something else
        from kvpool.peer import cell_rows

        replays = pd.read_csv(peer_csv, dtype={"replica": str})
        replays = replays[cell_rows(replays)] if len(replays) else replays
        bad = replays[~replays["valid"].astype(bool)] if len(replays) else replays
        lines += [f"  {row.cell} load~peer: the cell or vllm bench serve's replay of it is invalid (its level.json "
                  f"names the failed checks)" for row in bad.itertuples()]
    if routers_csv is not None:  # a router unit whose pool missed, leaked, or whose tokens are unattributed
        units = pd.read_csv(routers_csv).drop_duplicates(["cell", "router"])
        bad = units[~units["valid"].astype(bool)]
        lines += [f"  {row.cell} router~{row.router}: its run.json names the failed checks" for row in bad.itertuples()]
        invalid = pd.concat([invalid, bad[["cell"]]]) if len(bad) else invalid
        counted.append(f"{len(units)} router units")
    if contexts_csv is not None:  # a length's unit whose chain missed the pool, read warm, or answered apart
        units = pd.read_csv(contexts_csv)
        bad = units[~units["valid"].astype(bool)]
        lines += [f"  {row.cell} doc~{row.context}: its unit.json names the failed checks" for row in bad.itertuples()]
        invalid = pd.concat([invalid, bad[["cell"]]]) if len(bad) else invalid
        counted.append(f"{len(units)} length units")
    lines += [f"  backend~{row.backend}/chunk~{row.chunk}/tier~{row.tier}: kv_bytes {row.comparison}: {row.differ} of "
              f"{row.keys} chunks differ where they must agree bit for bit (e.g. {row.example_key})"
              for row in damaged.itertuples()]
    study = read_json(studyb_json) if studyb_json is not None else None
    if study is not None and not study["valid"]:
        from kvpool.studyb import gate_failures

        lines += [f"  Study B {reason} (results/studyb.md)" for reason in gate_failures(study)]
    if lines:
        raise SystemExit(
            f"{len(invalid)} of {len(table)} cells (or their load levels) failed the validity gate, "
            f"{len(damaged)} KV byte comparisons found damage, and Study B's blocks are "
            f"{'not run' if study is None else 'valid' if study['valid'] else 'INVALID'} "
            "(data kept; the tables, results/kv_bytes.md, results/studyb.md and results/report.html show them):\n"
            + "\n".join(lines))
    Path(out).write_text(f"{len(table)} cells valid ({_rests_on(table)}); no KV bytes differ where they must agree"
                         + "".join(f"; {unit} valid" for unit in counted)
                         + ("; Study B's blocks valid" if study is not None else "") + "\n")


def _rests_on(table: pd.DataFrame) -> str:
    """What the cells' verdicts rest on, from results/validity.csv: passed checks per cell and the
    checks that were not applicable or not verified, counted."""
    if "checks_passed" not in table or table.empty:
        return "checks not counted in this table"

    def count(column: str) -> int:
        return sum(len([name for name in str(value).split("; ") if name]) for value in table[column])

    passed = table["checks_passed"].astype(int)
    span = f"{passed.min()}" if passed.min() == passed.max() else f"{passed.min()}-{passed.max()}"
    return (f"each on {span} passed checks; {count('not_applicable')} not applicable, "
            f"{count('not_verified')} not verified")


def tier_disks(plan: dict) -> tuple[list[str], list[dict]]:
    """The whole disks behind a plan's pool directories, and how each directory resolved."""
    from kvpool.drive import block_devices

    resolved = [block_devices(d) for d in dict.fromkeys(plan_pool_dirs(plan))]
    return sorted({disk for record in resolved for disk in record["disks"]}), resolved


def _run_sampled_phase(plan: dict, run, drive_csv: str, power_csv: str, log_dir: str) -> tuple:
    """Run one timed phase with telemetry; record drive health before and after it, and the pool
    writes that failed in it (a full tier shows only in the replicas' and servers' logs)."""
    from kvpool.drive import drive_health

    disks, resolved = tier_disks(plan)
    health_before = [drive_health(d) for d in disks]
    log_start = logs.log_sizes(Path(log_dir))
    frame, meta, sampler = run(disks)
    meta["pool_write_errors"] = logs.new_lines_matching(Path(log_dir), log_start)
    for line in meta["pool_write_errors"]:
        log.error("a pool write failed (is the tier full?): %s", line)
    drive, power = sampler.frames()
    drive.to_csv(drive_csv, index=False)
    power.to_csv(power_csv, index=False)
    meta["telemetry"] = {**sampler.meta, "devices": resolved, "health_before": health_before,
                         "health_after": [drive_health(d) for d in disks]}
    return frame, meta


def phase_summary(raw_drive: pd.DataFrame, power: pd.DataFrame, telemetry: dict, requests: int,
                  gpus: list[int]) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """One timed window's telemetry (a phase, or a load level): the raw drive samples with iostat's
    derived columns for the interval each closes, the fleet's GPUs' power samples alone (a sampler may
    read every GPU of the host) and the window's summary."""
    from kvpool.drive import iostat
    from kvpool.telemetry import fleet_gpus_only, summarize_drive, summarize_power

    derived = iostat(raw_drive) if not raw_drive.empty else pd.DataFrame()
    if not raw_drive.empty:
        raw_drive = raw_drive.merge(derived.drop(columns=["phase", "cell"], errors="ignore"), on=["t_s", "device"],
                                    how="left")
    meta, power = fleet_gpus_only(telemetry, power, gpus)
    summary = {"started_at": meta["started_at"], "finished_at": meta["finished_at"], "duration_s": meta["duration_s"],
               "hz": meta["hz"], "devices": meta["devices"], "disks": meta["disks"],
               "drive": summarize_drive(derived, meta["duration_s"]), "power": summarize_power(power, meta, requests),
               "health_before": meta["health_before"], "health_after": meta["health_after"]}
    return raw_drive, power, summary


def run_telemetry(phase_files: dict, out_drive: str, out_power: str, out_summary: str, plan_path: str) -> None:
    """Merge a cell's per-phase samples into drive.csv / power.csv and summarize each phase.

    ``phase_files`` maps phase -> {"meta": json, "drive": csv, "power": csv, "records": csv}.
    Power counts the fleet's GPUs only (``plan_path``: the cell's plan), also in records of samplers
    that read every GPU of the host.
    """
    gpus = plan_gpus(yaml.safe_load(Path(plan_path).read_text()))
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


def run_ceiling(config: dict, tier: str, out: str) -> None:
    from kvpool.cells import tier_root
    from kvpool.drive import block_devices, sequential_read_ceiling

    root = tier_root(config, tier)
    result = sequential_read_ceiling(root / "kvpool-ceiling", config["drive_ceiling_bytes"])
    result["rated_gb_per_s"] = config["tier_rated_read_gbps"].get(tier)
    result["devices"] = block_devices(root)
    write_json(out, result)
    log.info("tier %s: sequential read %.2f GB/s (%s)", tier, result["gb_per_s"], result["method"])


def run_tier_compare(shared_cells: list[Cell], summaries: list[str], reuse_csvs: list[str],
                     drive_csvs: list[str], ceilings: list[str], *, tiers_csv: str,
                     csv_out: str, md_out: str) -> None:
    """The per-tier table (``tiers_csv``: each shared cell's drive and TTFT figures, with intervals) and
    Study A's Table 2 drawn from it."""
    ceiling_by_tier = {path.split("/")[-2]: read_json(path) for path in ceilings}
    rows = [summary.tier_row(cell, read_json(summary_path)["reuse"], read_records(reuse_csv),
                             read_frame_or_empty(drive_csv), ceiling_by_tier[cell.tier])
            for cell, summary_path, reuse_csv, drive_csv in zip(
                shared_cells, summaries, reuse_csvs, drive_csvs, strict=True)]
    tiers = pd.DataFrame(rows)
    tiers.to_csv(tiers_csv, index=False)
    table = summary.tier_compare(tiers)
    table.to_csv(csv_out, index=False)
    Path(md_out).write_text("# Table 2: drive tiers during the shared arm's reuse phase\n\n"
                            + summary.tier_compare_markdown(table))


def build_report(config: dict, cells: list[Cell], root: str, *, cell_table: str, table1_csv: str,
                 tier_table: str | None,
                 kv_bytes: str | None, out_html: str, figures_dir: str, tables_dir: str,
                 load: str | None = None, studyb: dict | None = None, peer: str | None = None,
                 routers: str | None = None, contexts: str | None = None) -> None:
    """Figures (PNG, SVG) and the self-contained page from the run's tables (``cell_table``,
    ``tier_table``, ``kv_bytes``: computed once, by their rules; None where a partial run has none)
    and, for the figures that draw every request and sample, the cells' records under ``root``."""
    from kvpool import figures, report

    results = report.collect(Path(root), cells, config)
    tables, figs = Path(tables_dir), Path(figures_dir)
    tables.mkdir(parents=True, exist_ok=True)
    table1 = pd.read_csv(cell_table, keep_default_na=False, na_values=[""])
    table1["valid"] = table1["valid"].astype(bool)
    table2 = pd.read_csv(tier_table).merge(table1[["cell", "valid"]], on="cell") if tier_table else pd.DataFrame()
    head = summary.headline(pd.read_csv(table1_csv))
    servers = report.pool_server_table(Path(root), cells)
    for name, frame in (("table1", table1), ("table2", table2), ("headline", head), ("pool_server", servers)):
        frame.to_csv(tables / f"{name}.csv", index=False)
        (tables / f"{name}.md").write_text(frame.to_markdown(index=False, floatfmt=".4g") + "\n")
    study = [("fig1_ttft_p50", figures.ttft_p50(table1)), ("fig2_ttft_p99", figures.ttft_p99(table1)),
             ("fig3_wall_clock", figures.wall_clock(table1)), ("fig4_power", figures.power(table1))]
    extra = [("ttft_ecdf", figures.ttft_ecdf(results.requests)),
             ("timeline", figures.timeline(results.drive, results.power, results.cells))]
    if table1["energy_per_followup_j"].notna().any():
        extra.append(("energy_per_followup", figures.energy(table1)))
    else:
        extra.append(("energy_per_followup", figures.placeholder_note(
            "Energy per follow-up", "not measured on this machine: no GPU energy counter")))
    rates = table2[["drive_read_active_gb_per_s", "ceiling_read_gb_per_s"]].astype(float) if len(table2) \
        else pd.DataFrame()
    why_not = "no drive read and no ceiling measured" if len(table2) else "no shared arm: no reload to compare"
    extra.append(("reload_efficiency", figures.reload_efficiency(table2)) if rates.notna().any().any()
                 else ("reload_efficiency", figures.placeholder_note(
                     "Reload read rate against the measured ceiling", why_not)))
    if table1["chunk"].nunique() > 1:
        extra.append(("ttft_by_chunk", figures.by_chunk(table1)))
    levels = pd.read_csv(load) if load and Path(load).exists() else pd.DataFrame()
    under_load = []
    if len(levels) and (levels["level"] != "c1").any():
        under_load.append(("load_ttft", figures.load_ttft(levels)))
        under_load.append(("load_throughput", figures.load_throughput(levels)))
        if (levels["level_kind"] == "rate").any():
            under_load.append(("load_goodput", figures.load_goodput(levels)))
        rates = levels.reindex(columns=["drive_read_gb_per_s", "loaded_gb_per_s"]).notna().any(axis=1)
        if (rates & (levels["arm"] == "shared")).any():
            ceilings = (table2[["backend", "chunk", "tier", "ceiling_read_gb_per_s"]].drop_duplicates() if len(table2)
                        else pd.DataFrame(columns=["backend", "chunk", "tier", "ceiling_read_gb_per_s"]))
            under_load.append(("load_reload_rate", figures.load_reload_rate(levels, ceilings)))
    drawn = {}
    for stem, plot in study + extra + under_load:
        drawn[stem] = {**figures.save(plot, figs, stem), "title": plot.labels.get("title", stem)}
    manifest = results.manifest
    studyb_part = _studyb_section(studyb) if studyb else None
    report.render_page(Path(__file__).with_name("templates") / "report.html.j2", Path(out_html), {
        "verdict": report.verdict(results.cells, studyb_part),
        "headline_figure": drawn["fig1_ttft_p50"],
        "generated_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "git": manifest.get("git", {}), "versions": {k: v for k, v in manifest.get("versions", {}).items() if v},
        "hardware": manifest.get("hardware", {}), "config": config, "tiers": results.tiers,
        "cells": results.cells.to_dict("records"),
        "headline_html": _html(report.headline_for_reading(head)),
        "table1_html": _html(report.cells_for_reading(table1)),
        "table2_html": _html(report.tiers_for_reading(table2)) if len(table2) else _html(table2),
        "study_figures": [drawn[s] for s, _ in study[1:]], "extra_figures": [drawn[s] for s, _ in extra],
        "caveats": report.caveats(results),
        "kv_bytes_html": _kv_bytes_html(Path(kv_bytes) if kv_bytes else None),
        "pool_server_html": _html(report.pool_servers_for_reading(servers)) if len(servers) else "",
        "load_html": _html(summary.load_for_reading(levels)) if len(levels) else "",
        "peer_html": _peer_html(peer) if peer else "",
        "routers": _routers_section(routers) if routers else None,
        "contexts": _contexts_section(contexts) if contexts else None,
        "load_figures": [drawn[s] for s, _ in under_load],
        "studyb": studyb_part,
    })


def _studyb_section(files: dict) -> dict:
    """Study B's part of the page (``files``: its validity.json, locality.csv, sessions summary,
    figures folder, windows table, crossover table and its figure's folder): the verdict, the tables
    and the figures."""
    from kvpool import report
    from kvpool.studyb import gate_failures

    gate = read_json(files["validity"])
    # the page's columns; the CSVs hold every one, observations included
    locality = pd.read_csv(files["locality"])[
        ["context", "step", "off_ttft_median_s", "on_ttft_median_s", "on_local_hit_tokens", "on_external_hit_tokens",
         "mean_paired_change_pct", "change_ci_low_pct", "change_ci_high_pct", "pairs_matched", "outputs_equal"]]
    sessions = pd.read_csv(files["sessions"])[
        ["placement", "off_wall_median_s", "on_wall_median_s", "mean_paired_change_pct", "change_ci_low_pct",
         "change_ci_high_pct", "turn_ttft_change_pct", "decode_change_pct", "turns_matched", "outputs_equal"]]
    windows = pd.read_csv(files["windows"])[
        ["window", "placement", "off_tokens_per_s_median", "on_tokens_per_s_median", "mean_paired_change_pct",
         "change_ci_low_pct", "change_ci_high_pct", "off_turn_ttft_median_s", "on_turn_ttft_median_s"]]
    crossover = pd.read_csv(files["crossover"])[
        ["context", "prefill_s", "reload_s", "speedup", "prefill_fit_s", "reload_fit_s", "break_even_read_gbps",
         "fit_read_gbps", "fit_overhead_s", "crossover_tokens"]]
    figures_dir = Path(files["figures"])
    crossover_shown, crossover_fit = report.crossover_for_reading(crossover)
    return {"valid": gate["valid"], "failures": gate_failures(gate), "blocks": list(gate["blocks"]),
            "pool": f"{gate['backend']} (chunk {gate['chunk']}, tier {gate['tier']})",
            "locality_html": _html(report.locality_for_reading(locality)),
            "sessions_html": _html(report.sessions_for_reading(sessions)),
            "windows_html": _html(report.windows_for_reading(windows)) if len(windows) else None,
            "crossover_html": _html(crossover_shown), "crossover_fit": crossover_fit,
            "figures": [{"png": figures_dir / f"{stem}.png", "title": title} for stem, title in
                        (("locality", "Locality chains: TTFT per step, OFF and ON"),
                         ("sessions", "Sessions: wall time per session, OFF and ON"))]
            + [{"png": Path(files["crossover_figures"]) / "crossover.png",
                "title": "Where the pool pays: prefill and reload against context, measured and fitted"}]}


def _kv_bytes_html(path: Path | None) -> str:
    from kvpool import report
    if path is None or not path.exists():
        return "<p>Not computed for this run (no pool digests).</p>"
    table = pd.read_csv(path, keep_default_na=False)
    findings = "".join(f"<p><b>Finding, {backend} chunk {chunk} {tier}:</b> {html.escape(found)}</p>"
                       for (backend, chunk, tier), _, found in kvbytes.findings(table))
    return _html(report.kv_bytes_for_reading(table)) + findings + "<ul>" + "".join(
        f"<li><b>{name}</b>: {meaning}</li>" for name, meaning in kvbytes.COMPARISONS.items()) + "</ul>"


def _routers_section(routers_csv: str) -> dict:
    """The report's routers section: the table of results/routers.csv and its figures beside it."""
    from kvpool import report
    from kvpool.figures import ROUTER_FIGURES

    folder = Path(routers_csv).with_suffix("")  # run_router_table's figures folder
    return {"html": _html(report.routers_for_reading(pd.read_csv(routers_csv))),
            "figures": [{"png": str(folder / f"{stem}.png"), "title": title}
                        for stem, (_, title) in ROUTER_FIGURES.items()]}


def _contexts_section(contexts_csv: str) -> dict:
    """The report's document-length section: results/contexts.csv and its figure beside it."""
    from kvpool import report

    folder = Path(contexts_csv).with_suffix("")  # run_contexts_table's figures folder
    return {"html": _html(report.contexts_for_reading(pd.read_csv(contexts_csv))),
            "figure": str(folder / "contexts.png")}


def _peer_html(peer_csv: str) -> str:
    from kvpool.peer import peer_for_reading

    table = pd.read_csv(peer_csv, dtype={"replica": str})
    return _html(peer_for_reading(table)) if len(table) else ""


def _html(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "<p>Nothing to show: the matrix has no cell of this kind.</p>"
    return frame.to_html(index=False, float_format=lambda v: f"{v:.4g}", na_rep="n/a", border=0)


def run_load_level(config: dict, cell: Cell, level_name: str, *, plan_path: str, prompts_path: str,
                   populate_csv: str, populate_digests: str, csv_out: str, json_out: str, drive_csv: str,
                   power_csv: str, log_dir: str, remove_pool: bool, reference_csv: str | None = None,
                   manifest_out: str | None = None, provenance_config: dict | None = None) -> None:
    """One load level of a cell (kvpool.load): the pool restored to what populate left, a fresh fleet,
    the follow-ups at the level, the level's own gate and telemetry summary in ``json_out``.

    A pool of files is restored by removing what earlier levels stored. A memory pool (an MP server's
    L1) cannot be: it went with the cell's servers, and the isolated arm's serving servers would keep
    what they stored. The level then starts fresh servers and populates them again, as the cell did,
    with the populate records beside the level's (``populate.csv``, ``populate.json``)."""
    from kvpool import load

    level = load.Level.from_name(level_name)
    plan = checked_ports(yaml.safe_load(Path(plan_path).read_text()))
    if manifest_out:
        write_json(manifest_out, provenance.manifest(provenance_config or config, REPO, cell=cell.name,
                                                     level=level.name))
    workload = prompts.read_workload(Path(prompts_path))
    prefill = _prefills(populate_csv, workload, cell)
    reference = read_records(reference_csv) if reference_csv else None
    if plan.get("memory_pool"):
        _run_memory_pool_level(config, cell, level, plan, plan_path, prompts_path, prefill, workload,
                               populate_csv, csv_out, json_out, drive_csv, power_csv, log_dir, reference)
        return
    root = pool_root(config, cell)
    if not root.is_dir():
        raise RuntimeError(f"the pool of {cell.name} is gone ({root}); re-run the cell from its populate: "
                           f"snakemake {Path(csv_out).parent}/reuse.csv --forcerun populate")
    dirs = plan_pool_dirs(plan)
    stored = kvbytes.read_digests(populate_digests)
    restored = load.restore_pool(dirs, stored)
    unchanged = kvbytes.unchanged(stored, kvbytes.pool_digests(dirs, stored))
    log.info("%s %s: pool restored to populate's %d files (%d removed)", cell.name, level.name,
             restored["kept_files"], restored["removed_files"])
    frame, meta = _run_sampled_phase(
        plan, lambda disks: phases.load_level(plan, workload, prefill, config, Path(log_dir) / "replicas", disks,
                                              level, out_dir=Path(csv_out).parent),
        drive_csv, power_csv, log_dir)
    restored = {**restored, "unchanged_before": unchanged}
    pool_ok = load.files_restored(unchanged)
    if remove_pool:  # the cell's last level: the tier holds one cell's pool at a time
        shutil.rmtree(root)
        log.info("removed the pool %s (keep_pools: false)", root)
    _finish_level(config, cell, level, frame, meta, restored, pool_ok, remove_pool, csv_out, json_out, drive_csv,
                  power_csv, plan, workload, reference)


def _run_memory_pool_level(config: dict, cell: Cell, level, plan: dict, plan_path: str, prompts_path: str,
                           prefill: dict[int, int], workload: list[dict], populate_csv: str, csv_out: str,
                           json_out: str, drive_csv: str, power_csv: str, log_dir: str,
                           reference: pd.DataFrame | None) -> None:
    """A memory pool's level: fresh servers, populated again (its own fleet), then the level's fleet."""
    from kvpool import load

    level_dir, logs_at = Path(csv_out).parent, Path(log_dir)
    again = {name: str(level_dir / name) for name in ("populate.csv", "populate.json", "populate-drive.csv",
                                                     "populate-power.csv", "populate-digests.csv")}
    timeout_s = phases.server_settings(config, plan)["startup_timeout_s"]
    with running_servers(plan, logs_at / "servers", timeout_s) as (plan, servers):
        run_populate(config, cell, plan_path=plan_path, prompts_path=prompts_path, csv_out=again["populate.csv"],
                     json_out=again["populate.json"], drive_csv=again["populate-drive.csv"],
                     power_csv=again["populate-power.csv"], digests_csv=again["populate-digests.csv"],
                     log_dir=str(logs_at / "populate"), servers=servers, plan=plan)
        frame, meta = _run_sampled_phase(
            plan, lambda disks: phases.load_level(plan, workload, prefill, config, logs_at / "replicas", disks,
                                                  level, servers, out_dir=level_dir),
            drive_csv, power_csv, log_dir)
    restored = load.repopulated(read_records(populate_csv), read_json(Path(populate_csv).with_suffix(".json")),
                                read_records(again["populate.csv"]), read_json(again["populate.json"]))
    log.info("%s %s: memory pool populated again (%d bytes, the cell's populate held %d)", cell.name, level.name,
             restored["bytes"], restored["cell_bytes"])
    _finish_level(config, cell, level, frame, meta, restored, load.memory_restored(restored), False, csv_out,
                  json_out, drive_csv, power_csv, plan, workload, reference)


def _finish_level(config: dict, cell: Cell, level, frame: pd.DataFrame, meta: dict, restored: dict, pool_ok: dict,
                  pool_removed: bool, csv_out: str, json_out: str, drive_csv: str, power_csv: str,
                  plan: dict, workload: list[dict], reference: pd.DataFrame | None = None) -> None:
    """A level's rows, its gate (its answers against the split-matched ``reference``) and its telemetry
    summary."""
    from kvpool import load, peer
    from kvpool.plan import batch_invariant

    _archive(frame, Path(csv_out), f"load-{level.name}")
    frame.to_csv(csv_out, index=False)
    in_flight = load.in_flight_limit(level, config.get("load", {}).get("max_in_flight", 1))
    if level.kind == "peer":  # vLLM's client reports no hits per request: the window's, against reuse's
        reused = read_records(str(Path(csv_out).parents[1] / "reuse.csv"))
        expected = int(reused["external_hit_tokens"].fillna(0).sum()) if cell.arm == "shared" else 0
        followups = {item["doc_id"]: len(item["followup"]) for item in workload}
        outputs = load.outputs_check(peer.with_reuse_splits(frame, reused), reference, in_flight,
                                     batch_invariant(config["engine"]))
        meta.update(pool_restore=restored,
                    **peer.checks(cell.arm, frame, followups, meta["window_external_tokens"], expected, pool_ok,
                                  validity.cold_reads(meta["drop_before_level"], config["max_resident_fraction"]),
                                  outputs))
    else:
        hits = load.attribution(frame, meta["window_external_tokens"])
        outputs = load.outputs_check(frame, reference, in_flight, batch_invariant(config["engine"]))
        meta.update(pool_restore=restored,
                    **load.level_checks(cell.arm, frame, hits, meta["drop_before_level"], pool_ok,
                                        config["workload"]["doc_tokens"], config["min_hit_fraction"],
                                        config["max_resident_fraction"], outputs))
    meta["pool_removed"] = pool_removed
    _write_unit(meta, len(frame), drive_csv, power_csv, plan, json_out, f"{cell.name} {level.name}")


def _write_unit(meta: dict, requests: int, drive_csv: str, power_csv: str, plan: dict, json_out: str,
                name: str) -> None:
    """A measured unit's record (a load level's, a router unit's, a length unit's), its telemetry window summarized
    beside its gate, and each failed check logged under ``name``."""
    _, _, window = phase_summary(read_frame_or_empty(drive_csv), read_frame_or_empty(power_csv), meta["telemetry"],
                                 requests, plan_gpus(plan))
    meta["summary"] = {"drive": window["drive"], "power": window["power"]}
    write_json(json_out, meta)
    for check_name, check in meta["checks"].items():
        if check["ok"] is False:
            log.error("%s invalid: %s is %s (needs %s)", name, check_name, check["value"], check["threshold"])


def run_peer_table(cells_run: list[Cell], *, reuse: dict, replays: dict, csv_out: str, md_out: str) -> None:
    """``results/peer.csv``: per cell, kvpool's TTFT (its reuse phase) beside vLLM's client's (the
    ``load~peer`` replay of the same follow-ups to the same replicas); ``reuse`` maps a cell to its
    reuse.csv and validity.json, ``replays`` to its replay's requests.csv and level.json."""
    from kvpool import peer

    rows = [row for cell in cells_run
            for row in peer.peer_rows(cell, read_records(reuse[cell]["csv"]), read_records(replays[cell]["csv"]),
                                      read_json(reuse[cell]["validity"])["valid"],
                                      read_json(replays[cell]["meta"])["valid"])]
    table = pd.DataFrame(rows)
    table.to_csv(csv_out, index=False)
    Path(md_out).write_text(peer.peer_markdown(table))
    for row in rows:
        log.info("%s replica %s: TTFT p50 kvpool %.4g s, vllm bench serve %.4g s (%+.1f%%)", row["cell"],
                 row["replica"], row["kvpool_ttft_p50_s"], row["vllm_ttft_p50_s"], row["p50_difference_pct"])


def run_load_table(config: dict, cells_run: list[Cell], *, reuse: dict, levels: dict, csv_out: str,
                   md_out: str) -> None:
    """``results/load.csv``: one row per cell and level (``c1`` is the cell's reuse phase; ``reuse``
    maps a cell to its reuse.csv, reuse.json, validity.json and telemetry summary; ``levels`` maps
    (cell, level) to the level's csv and json)."""
    from kvpool.model import engine_kv_bytes_per_token

    per_token, rows = engine_kv_bytes_per_token(config), []
    for cell in cells_run:
        files = reuse[cell]
        summary_ = read_json(files["telemetry"])["reuse"]
        cell_gate = read_json(files["validity"])
        rows.append(summary.load_row(cell, "c1", read_records(files["csv"]), {**read_json(files["meta"]), **cell_gate},
                                     summary_["drive"], _phase_power(summary_), cell_gate["valid"], config, per_token))
        for (level_cell, level), paths in levels.items():
            if level_cell == cell:
                meta = read_json(paths["meta"])
                power = energy_mean_power(meta["summary"]["power"], meta["telemetry"].get("duration_s"))
                rows.append(summary.load_row(cell, level, read_records(paths["csv"]), meta,
                                             meta["summary"]["drive"], power, meta["valid"], config, per_token))
    table = pd.DataFrame(rows)
    table.to_csv(csv_out, index=False)
    Path(md_out).write_text("# Under load: each cell's follow-ups per level\n\n" + summary.load_markdown(table))



def run_studyb_workload(config: dict, model: str, out: str) -> None:
    """Study B's payloads, the same in every block (kvpool.studyb.make_workload)."""
    from kvpool import studyb

    study = studyb.resolved(config)
    encode = None
    if config["engine"]["model"]:  # a real model can be asked for planted values (kvpool.studyb.plant)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    workload = studyb.make_workload(vocabulary(model), study, config["replicas"], encode)
    write_json(out, workload)
    log.info("Study B: %d chains, %d sessions of %d turns, %d warm-ups", len(workload["chains"]),
             len(workload["sessions"]), study["turns"], len(workload["warmups"]))


def studyb_pool_root(config: dict, study: dict) -> Path:
    """The folder of the ON blocks' pool in the study's tier (each block starts it empty)."""
    from kvpool.studyb import ON, block_cell

    return run_pools(config, study["tier"]) / "studyb" / block_cell(study, ON).name


def run_studyb_block(config: dict, block: str, *, model: str, workload_path: str, plan_out: str, manifest_out: str,
                     csv_out: str, json_out: str, reference_out: str, log_dir: str, known: list[str] = (),
                     provenance_config: dict | None = None) -> None:
    """One of Study B's blocks: its plan (ON, the study's shared pool, empty at the start; OFF, no
    connector), the requests, the block's checks in ``json_out``. An ON block's answers are compared
    with pool-less recomputes in their splits (``reference_out``): the earlier blocks' (``known``: their
    requests.csv, an OFF block's answers being pool-less, and reference.csv), and what none of them has,
    computed after the block's fleet stops."""
    from kvpool import reference, studyb
    from kvpool.checks import status, verdict
    from kvpool.plan import batch_invariant

    study = studyb.resolved(config)
    arm = studyb.block_arm(block)
    cell = studyb.block_cell(study, arm)
    root = studyb_pool_root(config, study)
    plan = checked_ports(_new_plan(config, cell, model, Path(plan_out).parent, pool_root=root))
    Path(plan_out).write_text(yaml.safe_dump(plan, sort_keys=False, width=200))
    write_json(manifest_out, provenance.manifest(provenance_config or config, REPO, block=block, cell=cell.name))
    workload = read_json(workload_path)
    with _unit_pool(config, root, plan):  # independently restarted: nothing of an earlier block's pool is left
        rows, meta, sent = phases.studyb_block(plan, block, workload, study, config, Path(log_dir))
    frame = pd.DataFrame(rows, columns=studyb.COLUMNS)
    _archive(frame, Path(csv_out), f"studyb-{block}")
    frame.to_csv(csv_out, index=False)
    invariant = batch_invariant(config["engine"])
    compared = pd.DataFrame(columns=reference.COLUMNS)
    if arm == studyb.ON:
        compared = _split_reference(config, model, studyb.under_test(frame, invariant), sent,
                                    _known_answers(known), Path(log_dir).parent / "reference")
    compared.to_csv(reference_out, index=False)
    checks = studyb.block_checks(frame, arm, study, config["min_hit_fraction"], compared, invariant)
    meta.update(arm=arm, cell=cell.name, checks=checks, valid=verdict(checks),
                information={"chain_answers_agree": studyb.answer_agreement(frame)})
    write_json(json_out, meta)
    for name, check in checks.items():
        if status(check) == "failed":
            log.error("Study B block %s invalid: %s is %s (needs %s)", block, name, check["value"],
                      check["threshold"])


def _known_answers(paths: list[str]) -> pd.DataFrame:
    """Pool-less answers recorded by earlier units, as reference rows: an OFF block's requests (each in
    its own split) and any reference.csv."""
    from kvpool import reference

    frames = []
    for path in paths:
        rows = read_records(path)
        if "arm" in rows:  # a Study B block's requests: only an OFF block's ran without a pool
            off = rows[(rows["arm"] == "off") & (rows["kind"] != "warmup")]
            frames.append(reference.twin_rows(off.assign(key=off["payload_sha256"]), "off_block"))
        else:
            frames.append(reference.normalized(rows))
    return pd.concat(frames, ignore_index=True) if frames else reference.normalized(None)


def _split_reference(config: dict, model: str, measured: pd.DataFrame, prompts: dict[str, list[int]],
                     known: pd.DataFrame, log_dir: Path) -> pd.DataFrame:
    """The reference rows for ``measured`` (requests keyed by payload): those of ``known`` for its
    prompts, and every (prompt, split) none of them matches, computed now on one replica with no pool."""
    from kvpool import reference

    known = reference.normalized(known)
    requests = reference.requests_for(reference.missing(measured, known), prompts)
    used = known[known["key"].isin(set(measured["key"]))]
    if not requests:
        return used
    log.info("reference: %d prompts in their measured splits on a replica with no pool", len(requests))
    computed = phases.reference(reference_replica(config, model), requests, config, log_dir)
    _refuse_failed_reference(computed)
    return pd.concat([used, computed], ignore_index=True)


def run_studyb_tables(config: dict, blocks: dict, *, locality_csv: str, sessions_csv: str, summary_csv: str,
                      validity_out: str, md_out: str, figures_dir: str, windows_csv: str | None = None) -> None:
    """Study B's tables from every block (``blocks``: name -> requests.csv and block.json): the
    locality chains (``locality_csv``), every session turn (``sessions_csv``) and the sessions per
    placement (``summary_csv``), the study's gate (each block's checks and the ON/OFF pairing) and a
    Markdown page with the tables and figures."""
    from kvpool import figures, studyb
    from kvpool.checks import FAILED, status, tally, verdict

    study = studyb.resolved(config)
    names = list(blocks)
    rows = pd.concat([read_records(paths["csv"]) for paths in blocks.values()], ignore_index=True)
    pairs = studyb.block_pairs(names)
    locality = studyb.locality_table(rows, pairs)
    locality.to_csv(locality_csv, index=False)
    turns = rows[rows["kind"] == "session"].merge(
        studyb.session_walls(rows)[["block", "placement", "session", "wall_s"]], on=["block", "placement", "session"])
    turns = turns.rename(columns={"wall_s": "session_wall_s", "context": "prompt_context"})
    turns.drop(columns=["kind", "chain", "step", "window", "output_text"], errors="ignore").to_csv(sessions_csv,
                                                                                                  index=False)
    sessions = studyb.sessions_table(rows, pairs)
    sessions.to_csv(summary_csv, index=False)
    windows = studyb.windows_table(rows, pairs, config["workload"]["output_tokens"])
    if windows_csv:
        windows.to_csv(windows_csv, index=False)
    metas = {name: read_json(paths["meta"]) for name, paths in blocks.items()}
    checks = studyb.pairing_checks(rows, pairs)
    gate = {"blocks": {name: {"arm": meta["arm"], "valid": meta["valid"],
                              "failed": [c for c, check in meta["checks"].items() if status(check) == FAILED],
                              "checks": tally(meta["checks"])}
                       for name, meta in metas.items()},
            "checks": checks, "information": {"outputs_equal_across_pairs": studyb.pairing_agreement(rows, pairs)},
            "backend": study["backend"], "tier": study["tier"], "chunk": study["chunk"]}
    gate["valid"] = all(b["valid"] for b in gate["blocks"].values()) and verdict(checks)
    write_json(validity_out, gate)
    folder = Path(figures_dir)
    folder.mkdir(parents=True, exist_ok=True)
    drawn = [figures.save(figures.locality(rows), folder, "locality"),
             figures.save(figures.sessions(studyb.with_pairs(studyb.session_walls(rows), pairs)), folder, "sessions")]
    links = [os.path.relpath(d["png"], Path(md_out).parent) for d in drawn]
    Path(md_out).write_text(studyb.markdown(study, names, gate, locality, sessions, links, windows))
    if not gate["valid"]:
        log.error("Study B is INVALID: %s", studyb.gate_failures(gate))


def run_crossover(config: dict, *, locality_csv: str, csv_out: str, md_out: str, figures_dir: str) -> None:
    """Where the pool pays (kvpool.crossover), from Study B's locality table: the prefill and reload
    models fitted per context, the crossover context and the break-even read rates."""
    from kvpool import crossover, figures, studyb
    from kvpool.model import engine_kv_bytes_per_token

    per_token = engine_kv_bytes_per_token(config)
    if per_token is None:
        raise ValueError(f"the crossover needs the model's KV bytes per token, and {config['engine']['model']} "
                         "has no config.json here to read them from")
    frame, fit = crossover.table(read_records(locality_csv), per_token, studyb.resolved(config)["tier"])
    frame.to_csv(csv_out, index=False)
    drawn = figures.save(figures.crossover(frame, fit), Path(figures_dir), "crossover")
    page = crossover.markdown(frame, fit)
    Path(md_out).write_text(f"{page}\n![crossover]({os.path.relpath(drawn['png'], Path(md_out).parent)})\n")
    if isinstance(fit, str):
        log.warning("no crossover fit: %s", fit)


def run_context_unit(config: dict, cell: Cell, tokens: int, *, model: str, plan_out: str, manifest_out: str,
                     csv_out: str, json_out: str, reference_out: str, drive_csv: str, power_csv: str, log_dir: str,
                     provenance_config: dict) -> None:
    """One context unit (kvpool.contexts): its own plan on a fresh pool of the cell's kind, one fleet,
    each document's locality chain with the pool dropped before the cross step; the rows, the answers'
    split-matched reference (``reference_out``), the unit's gate and its telemetry summary."""
    from kvpool import contexts, reference, studyb
    from kvpool.checks import verdict

    study = contexts.chain_study(config, cell, tokens)
    root = run_pools(config, cell.tier) / "contexts" / cell.name / f"doc~{tokens}"
    plan = checked_ports(_new_plan(config, cell, model, Path(csv_out).parent, pool_root=root))
    Path(plan_out).write_text(yaml.safe_dump(plan, sort_keys=False, width=200))
    write_json(manifest_out, provenance.manifest(provenance_config, REPO, cell=cell.name, doc_tokens=tokens))
    workload = studyb.make_workload(vocabulary(model), study, config["replicas"])
    with _unit_pool(config, root, plan):
        frame, meta = _run_sampled_phase(
            plan, lambda disks: phases.context_unit(plan, workload, study, config, Path(log_dir), disks),
            drive_csv, power_csv, log_dir)
    _archive(frame, Path(csv_out), f"doc-{tokens}")
    frame.to_csv(csv_out, index=False)
    # the chains' answers against pool-less recomputes in their splits, computed now that the fleet stopped
    compared = _split_reference(config, model, studyb.under_test(frame), meta.pop("prompts"),
                                reference.normalized(None), Path(log_dir) / "reference")
    compared.to_csv(reference_out, index=False)
    checks = contexts.unit_checks(frame, meta["drops_before_cross"], study, config["min_hit_fraction"],
                                  config["max_resident_fraction"], compared)
    agreement = contexts.answer_agreement(frame)
    if agreement["cold_agrees"] < agreement["chains"]:
        log.info("%s doc~%d: the cold answer differs from the reuse steps' in %d of %d chains (another prefill "
                 "split; the gate compares each step with a recompute in its own split)", cell.name, tokens,
                 agreement["chains"] - agreement["cold_agrees"], agreement["chains"])
    meta.update(doc_tokens=tokens, checks=checks, information={"answers_agree": agreement}, valid=verdict(checks))
    _write_unit(meta, len(frame), drive_csv, power_csv, plan, json_out, f"{cell.name} doc~{tokens}")


def run_contexts_table(config: dict, units: list[tuple[Cell, int]], *, csvs: list[str], metas: list[str],
                       csv_out: str, md_out: str, figures_dir: str) -> None:
    """results/contexts.csv and .md and their figure: per shared cell, its lengths' cold, own-cache and
    pool TTFT medians with the prefill and reload models fitted (kvpool.contexts)."""
    from kvpool import contexts, figures
    from kvpool.model import engine_kv_bytes_per_token

    per_token = engine_kv_bytes_per_token(config)
    if per_token is None:
        raise ValueError(f"the length sweep needs the model's KV bytes per token, and {config['engine']['model']} "
                         "has no config.json here to read them from")
    rows = []
    for (cell, tokens), csv, meta_path in zip(units, csvs, metas, strict=True):
        meta = read_json(meta_path)
        rows.append(contexts.unit_row(cell, tokens, read_records(csv), meta["valid"],
                                      meta["summary"]["drive"].get("read_active_gb_per_s")))
    table, fits = contexts.table(rows, per_token)
    table.to_csv(csv_out, index=False)
    drawn = figures.save(figures.contexts(table, fits), Path(figures_dir), "contexts")
    page = contexts.markdown(table, fits)
    Path(md_out).write_text(f"{page}\n![contexts]({os.path.relpath(drawn['png'], Path(md_out).parent)})\n")
    for name, fit in fits.items():
        if isinstance(fit, str):
            log.warning("%s: no fit over its lengths: %s", name, fit)


def router_pool_root(config: dict, cell: Cell, router: str) -> Path:
    """A router unit's own pool folder in the cell's tier (each unit starts it empty)."""
    return run_pools(config, cell.tier) / "routers" / cell.name / f"router~{router}"


def run_router_unit(config: dict, cell: Cell, router: str, *, model: str, prompts_path: str, plan_out: str,
                    manifest_out: str, csv_out: str, json_out: str, drive_csv: str, power_csv: str, log_dir: str,
                    provenance_config: dict, reference_csv: str | None = None) -> None:
    """One router unit (kvpool.routers): its own plan on a fresh pool of the cell's kind, one fleet, every
    request where the router sends it; the rows, the unit's gate and its telemetry summary."""
    from kvpool import routers

    unit_dir = Path(csv_out).parent
    root = router_pool_root(config, cell, router)
    plan = checked_ports(_new_plan(config, cell, model, unit_dir, pool_root=root))
    Path(plan_out).write_text(yaml.safe_dump(plan, sort_keys=False, width=200))
    write_json(manifest_out, provenance.manifest(provenance_config, REPO, cell=cell.name, router=router))
    workload = prompts.read_workload(Path(prompts_path))
    with _unit_pool(config, root, plan):
        frame, meta = _run_sampled_phase(
            plan, lambda disks: phases.router_unit(plan, workload, router, config, Path(log_dir), disks),
            drive_csv, power_csv, log_dir)
    _archive(frame, Path(csv_out), f"router-{router}")
    frame.to_csv(csv_out, index=False)
    from kvpool.plan import batch_invariant

    meta.update(routers.checks(cell.arm, frame, meta["windows"], meta["drop_before_followups"], meta["loss"],
                               config["workload"]["doc_tokens"], config["min_hit_fraction"],
                               config["max_resident_fraction"], read_records(reference_csv) if reference_csv else None,
                               batch_invariant(config["engine"]), config["routers"]["hot"]["concurrency"]))
    _write_unit(meta, len(frame), drive_csv, power_csv, plan, json_out, f"{cell.name} router~{router}")


def run_router_table(units: list[tuple[Cell, str]], *, csvs: list[str], metas: list[str], csv_out: str,
                     md_out: str, figures_dir: str) -> None:
    """results/routers.csv and .md, and their figures: per cell, router and phase."""
    from kvpool import figures, routers

    rows = []
    for (cell, router), csv, meta_path in zip(units, csvs, metas, strict=True):
        frame, meta = read_records(csv), read_json(meta_path)
        for phase in routers.PHASES:
            sent = frame[frame["phase"] == phase]
            if sent.empty:
                continue
            for group, part in routers.groups(sent, phase):
                sources = routers.phase_sources(part, meta["windows"].get(phase) if group == "all" else None)
                rows.append(routers.phase_row(cell, router, phase, part, sources, meta["valid"], group=group))
    table = pd.DataFrame(rows)
    table.to_csv(csv_out, index=False)
    Path(md_out).write_text(routers.markdown(table))
    out = Path(figures_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stem, (draw, _) in figures.ROUTER_FIGURES.items():
        figures.save(draw(table), out, stem)
