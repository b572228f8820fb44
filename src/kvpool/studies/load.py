"""Load as a dimension: each cell's follow-ups at several closed-loop concurrencies and open-loop rates.

A level is named ``c<N>`` (N follow-ups in flight across the fleet, each starting when one ends) or
``r<rate>`` (requests per second, seeded Poisson arrivals, optional gamma burstiness as ``vllm bench
serve`` draws them, at most ``load.max_in_flight`` in flight). ``c1`` is the cell's reuse phase itself;
every other level is its own measured unit, ``results/cells/<cell>/load~<level>/``, run on the pool
restored to exactly what populate left.

At more than one request in flight a replica's ``/metrics`` deltas no longer belong to one request, so
each request's hits are its response's ``usage.prompt_tokens_details.cached_tokens`` (a serving replica
that never held the document has nothing of it in its own cache: every cached token came from the
pool), and their sum is checked against the serving replicas' ``/metrics`` deltas over the level.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import pandas as pd

from kvpool.cells import Arm, Cell, pool_root
from kvpool.engine import prompts
from kvpool.engine.client import RequestResult, complete, new_session
from kvpool.engine.cross_router import followup_route
from kvpool.engine.fleet import running_servers
from kvpool.engine.plan import batch_invariant, plan_pool_dirs
from kvpool.engine.plan_types import Plan, read_plan
from kvpool.engine.processes import PoolServer
from kvpool.measure import kvbytes, legacy, provenance, records, validity
from kvpool.measure.checks import check, verdict
from kvpool.measure.files import read_json, write_json
from kvpool.measure.records import LevelRecord, read_records
from kvpool.measure.reuse_checks import (
    files_restored,
    memory_restored,
    outputs_check,
    repopulated,
    request_checks,
    restore_pool,
)
from kvpool.measure.timed import (
    drop_pool,
    external_window,
    replica_error,
    request_row,
    scrape_serving,
    server_settings,
    timed_fleet,
    times_window,
    write_unit,
)
from kvpool.measure.unit import UnitPaths, run_unit
from kvpool.measure.unit_plan import checked_ports
from kvpool.settings import PHASE_SETTINGS, reads
from kvpool.studies import peer
from kvpool.studies.peer import PEER_LEVEL, replay_with_vllm_bench
from kvpool.studies.study_a import prefill_replicas, run_populate

LEVEL_PATTERN = r"c[0-9]+|r[0-9]+(\.[0-9]+)?|peer(-descending)?"


@dataclass(frozen=True)
class Level:
    """A unit of a cell's load chain: ``concurrency`` (N in flight), ``rate`` (open-loop arrivals per
    second) or ``peer`` (vLLM's own client replaying the reuse phase one at a time, kvpool.studies.peer,
    its serving replicas' runs in ``order``)."""

    kind: str
    value: float
    order: str = peer.ORDERS[0]

    @property
    def name(self) -> str:
        if self.kind == "peer":
            return peer.level_name(self.order)
        if self.kind == "concurrency":
            return f"c{int(self.value)}"
        return f"r{self.value:g}"

    @classmethod
    def from_name(cls, name: str) -> Level:
        if name.startswith(peer.PEER_LEVEL) and peer.order_of(name) in peer.ORDERS:
            return cls("peer", 1, peer.order_of(name))
        if name.startswith("c"):
            return cls("concurrency", int(name[1:]))
        if name.startswith("r"):
            return cls("rate", float(name[1:]))
        raise ValueError(f"a load level is c<concurrency>, r<rate> or peer, not {name!r}")


def levels(config: dict) -> list[Level]:
    """The configured levels other than ``c1`` (the reuse phase), in config order."""
    load = config["load"]
    return ([Level("concurrency", n) for n in load["concurrency"] if n != 1]
            + [Level("rate", float(r)) for r in load["rates"]])


def load_chain(config: dict, cell: Cell | None = None) -> list[Level]:
    """Every unit that runs on ``cell``'s pool after its reuse phase, in run order: the peer replay of
    that phase first when ``peer.enabled`` and the cell's arm is one of ``peer.arms``, then the load
    levels in config order, so that a level added later builds only itself. The last unit removes the
    pool when pools are not kept. Without ``cell``: every unit any cell runs."""
    replay = legacy.peer_replay(config["peer"], peer.ORDERS[0])
    replayed = replay["enabled"] and (cell is None or cell.arm in replay["arms"])
    orders = replay["orders"] if replayed else []
    return [Level("peer", 1, order) for order in orders] + levels(config)


def arrival_offsets(rate: float, count: int, burstiness: float, seed: int) -> np.ndarray:
    """Seconds from the level's start at which each of ``count`` requests is sent: gamma-distributed
    gaps of mean 1/rate, shape ``burstiness`` (1: a Poisson process; below 1 burstier), the first at 0."""
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if count else np.array([])


def in_flight_limit(level: Level, max_in_flight: int) -> int:
    return int(level.value) if level.kind == "concurrency" else max_in_flight


async def send_level(session, level: Level, requests: list[tuple[int, str, list[int]]], output_tokens: int,
                     timeout_s: float, max_in_flight: int, burstiness: float, seed: int
                     ) -> list[tuple[int, float, RequestResult]]:
    """Send ``requests`` (doc_id, serving replica URL, prompt) at ``level``: closed loop, N in flight; or
    open loop, each at its seeded arrival time, no more than ``max_in_flight`` at once. Returns
    (doc_id, offset the request was due at, result) per request, in request order."""
    limit = asyncio.Semaphore(in_flight_limit(level, max_in_flight))
    due = (arrival_offsets(level.value, len(requests), burstiness, seed) if level.kind == "rate"
           else np.zeros(len(requests)))
    start = time.monotonic()

    async def one(offset: float, doc_id: int, url: str, prompt: list[int]):
        await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
        async with limit:
            return doc_id, float(offset), await complete(session, url, prompt, output_tokens, timeout_s)

    return await asyncio.gather(*(one(offset, *request) for offset, request in zip(due, requests, strict=True)))


def attribution(rows: pd.DataFrame, window_external: int | None) -> dict:
    """The level's pool hits two ways: the responses' ``cached_tokens`` summed, and the serving replicas'
    ``/metrics`` external-transfer deltas over the level's window; they must agree."""
    per_request = int(rows["cached_tokens"].fillna(0).sum())
    agree = window_external is not None and per_request == window_external
    return {"per_request_cached_tokens": per_request, "window_external_tokens": window_external, "agree": agree,
            "used": "per-request usage.prompt_tokens_details.cached_tokens, checked against /metrics deltas "
                    "over the level's window"}


def level_checks(arm: str, rows: pd.DataFrame, hits: dict, drop: dict, pool_restored: dict, doc_tokens: int,
                 min_hit_fraction: float, max_resident_fraction: float, outputs: dict | None = None) -> dict:
    """A level's gate: what the cell's gate asks of its reuse, on this level's requests, with its
    answers against the recompute (``outputs``: :func:`outputs_check`). The pool's hits are judged on the
    requests that were answered: a failed one (a replica that died) is the errors check's, and counting
    its missing hit as none would hide what the answered ones loaded."""
    answered = rows[rows["error"].fillna("") == ""]
    fractions = answered["cached_tokens"].fillna(0).astype(float) / doc_tokens
    checks = {
        **request_checks(rows),
        "pool_restored": pool_restored,
        "hit_attribution": check(hits["agree"], hits, "the two sums equal"),
    }
    checks["cold_reads"] = validity.cold_reads(drop, max_resident_fraction)  # as the cell's gate
    if arm == Arm.SHARED:
        worst = float(fractions.min()) if len(fractions) else None
        checks["pool_hits"] = check(worst is not None and worst >= min_hit_fraction, worst, min_hit_fraction,
                                    answered=len(answered), requests=len(rows))
    else:
        loaded = int(rows["cached_tokens"].fillna(0).sum())
        checks["isolation"] = check(loaded == 0, loaded, 0)
    if outputs is not None:
        checks["output_matches_recompute"] = outputs
    return {"valid": verdict(checks), "checks": checks}


log = logging.getLogger(__name__)


def _level_sections(config: dict, wildcards) -> dict:
    """An open-loop level reads its arrival settings, the peer level vLLM's client's; a closed-loop one
    none of ``load``'s keys, so a new level in the lists leaves the measured levels as they are."""
    arrivals = wildcards.level.startswith("r")
    return {"load": {key: config["load"][key] for key in ("max_in_flight", "burstiness", "seed")} if arrivals else {},
            "peer": config["peer"] if wildcards.level.startswith(PEER_LEVEL) else {}}


@reads(*PHASE_SETTINGS, "min_hit_fraction", "max_resident_fraction", picked=_level_sections)
def run_load_level(config: dict, cell: Cell, level_name: str, *, plan_path: str, prompts_path: str,
                   populate_csv: str, populate_digests: str, csv_out: str, json_out: str, drive_csv: str,
                   power_csv: str, log_dir: str, remove_pool: bool, reference_csv: str | None = None,
                   manifest_out: str | None = None, provenance_config: dict | None = None) -> None:
    """One load level of a cell (kvpool.studies.load): the pool restored to what populate left, a fresh fleet,
    the follow-ups at the level, the level's own gate and telemetry summary in ``json_out``.

    A pool of files is restored by removing what earlier levels stored. A memory pool (an MP server's
    L1) cannot be: it went with the cell's servers, and the isolated arm's serving servers would keep
    what they stored. The level then starts fresh servers and populates them again, as the cell did,
    with the populate records beside the level's (``populate.csv``, ``populate.json``)."""

    level = Level.from_name(level_name)
    plan = checked_ports(read_plan(plan_path))
    if manifest_out:
        write_json(manifest_out, provenance.manifest(provenance_config or config, cell=cell.name,
                                                     level=level.name))
    workload = prompts.read_workload(Path(prompts_path))
    prefill = prefill_replicas(populate_csv, workload, cell)
    reference = read_records(reference_csv) if reference_csv else None
    if plan.memory_pool:
        _run_memory_pool_level(config, cell, level, plan, plan_path, prompts_path, prefill, workload,
                               populate_csv, csv_out, json_out, drive_csv, power_csv, log_dir, reference)
        return
    root = pool_root(config, cell)
    if not root.is_dir():
        raise RuntimeError(f"the pool of {cell.name} is gone ({root}); re-run the cell from its populate: "
                           f"snakemake {Path(csv_out).parent}/reuse.csv --forcerun populate")
    dirs = plan_pool_dirs(plan)
    stored = kvbytes.read_digests(populate_digests)
    restored = restore_pool(dirs, stored)
    unchanged = kvbytes.unchanged(stored, kvbytes.pool_digests(dirs, stored))
    log.info("%s %s: pool restored to populate's %d files (%d removed)", cell.name, level.name,
             restored["kept_files"], restored["removed_files"])
    unit = run_unit(
        plan, lambda disks: load_level(plan, workload, prefill, config, Path(log_dir) / "replicas", disks,
                                       level, out_dir=Path(csv_out).parent),
        UnitPaths(csv_out, json_out, drive_csv, power_csv, log_dir), f"load-{level.name}")
    restored = {**restored, "unchanged_before": unchanged}
    pool_ok = files_restored(unchanged)
    if remove_pool:  # the cell's last level: the tier holds one cell's pool at a time
        shutil.rmtree(root)
        log.info("removed the pool %s (keep_pools: false)", root)
    _finish_level(config, cell, level, unit.frame, unit.meta, restored, pool_ok, remove_pool, csv_out, json_out,
                  drive_csv, power_csv, plan, workload, reference)


def _run_memory_pool_level(config: dict, cell: Cell, level, plan: Plan, plan_path: str, prompts_path: str,
                           prefill: dict[int, int], workload: list[dict], populate_csv: str, csv_out: str,
                           json_out: str, drive_csv: str, power_csv: str, log_dir: str,
                           reference: pd.DataFrame | None) -> None:
    """A memory pool's level: fresh servers, populated again (its own fleet), then the level's fleet."""

    level_dir, logs_at = Path(csv_out).parent, Path(log_dir)
    again = {name: str(level_dir / name) for name in ("populate.csv", "populate.json", "populate-drive.csv",
                                                     "populate-power.csv", "populate-digests.csv")}
    timeout_s = server_settings(config, plan)["startup_timeout_s"]
    with running_servers(plan, logs_at / "servers", timeout_s) as (plan, servers):
        run_populate(config, cell, plan_path=plan_path, prompts_path=prompts_path, csv_out=again["populate.csv"],
                     json_out=again["populate.json"], drive_csv=again["populate-drive.csv"],
                     power_csv=again["populate-power.csv"], digests_csv=again["populate-digests.csv"],
                     log_dir=str(logs_at / "populate"), servers=servers, plan=plan)
        unit = run_unit(
            plan, lambda disks: load_level(plan, workload, prefill, config, logs_at / "replicas", disks,
                                           level, servers, out_dir=level_dir),
            UnitPaths(csv_out, json_out, drive_csv, power_csv, log_dir), f"load-{level.name}")
    restored = repopulated(read_records(populate_csv), read_json(Path(populate_csv).with_suffix(".json")),
                                read_records(again["populate.csv"]), read_json(again["populate.json"]))
    log.info("%s %s: memory pool populated again (%d bytes, the cell's populate held %d)", cell.name, level.name,
             restored["bytes"], restored["cell_bytes"])
    _finish_level(config, cell, level, unit.frame, unit.meta, restored, memory_restored(restored), False, csv_out,
                  json_out, drive_csv, power_csv, plan, workload, reference)


def _finish_level(config: dict, cell: Cell, level, frame: pd.DataFrame, meta: dict, restored: dict, pool_ok: dict,
                  pool_removed: bool, csv_out: str, json_out: str, drive_csv: str, power_csv: str,
                  plan: Plan, workload: list[dict], reference: pd.DataFrame | None = None) -> None:
    """A level's rows, its gate (its answers against the split-matched ``reference``) and its telemetry
    summary."""
    in_flight = in_flight_limit(level, config.get("load", {}).get("max_in_flight", 1))
    if level.kind == "peer":  # vLLM's client reports no hits per request: the window's, against reuse's
        reused = read_records(str(Path(csv_out).parents[1] / "reuse.csv"))
        expected = int(reused["external_hit_tokens"].fillna(0).sum()) if cell.arm == Arm.SHARED else 0
        followups = {item["doc_id"]: len(item["followup"]) for item in workload}
        outputs = outputs_check(peer.with_reuse_splits(frame, reused), reference, in_flight,
                                     batch_invariant(config["engine"]))
        gate = peer.checks(cell.arm, frame, followups, meta["window_external_tokens"], expected, pool_ok,
                           validity.cold_reads(meta["drop_before_level"], config["max_resident_fraction"]), outputs)
    else:
        hits = attribution(frame, meta["window_external_tokens"])
        outputs = outputs_check(frame, reference, in_flight, batch_invariant(config["engine"]))
        gate = level_checks(cell.arm, frame, hits, meta["drop_before_level"], pool_ok, config["workload"]["doc_tokens"],
                            config["min_hit_fraction"], config["max_resident_fraction"], outputs)
    meta.update(pool_restore=restored,
                **validity.with_served(gate, meta, config["engine"]["max_model_len"], cell.chunk))
    meta["pool_removed"] = pool_removed
    write_unit(meta, len(frame), drive_csv, power_csv, plan, json_out, f"{cell.name} {level.name}")


async def _load(replicas, workload, route, prefill, cfg, level
                ) -> tuple[list[dict], float, float, int | None, dict | None]:

    # a closed-loop level has no arrivals to draw and keeps its own N in flight
    load = cfg["load"] if level.kind == "rate" else {"max_in_flight": int(level.value), "burstiness": 1.0, "seed": 0}
    output_tokens, timeout_s = cfg["workload"]["output_tokens"], cfg["engine"]["request_timeout_s"]
    by_index = {r.index: r for r in replicas}
    serving = sorted({route[item["doc_id"]] for item in workload})
    requests = [(item["doc_id"], by_index[route[item["doc_id"]]].url, item["followup"]) for item in workload]
    async with new_session() as session:
        before = await scrape_serving(session, by_index, serving)
        started = time.time()
        sent = await send_level(session, level, requests, output_tokens, timeout_s, load["max_in_flight"],
                                load["burstiness"], load["seed"])
        finished = time.time()
        try:
            after = await scrape_serving(session, by_index, serving)
            window, times = external_window(before, after), times_window(before, after)
        except (aiohttp.ClientError, TimeoutError):
            window = times = None
    rows = []
    for doc_id, due, result in sent:
        serve = by_index[route[doc_id]]
        if result.error:
            result.error = replica_error(serve, "the request", result.error)
        # a serving replica that never held the document: every cached token came from the pool
        hits = {"external_kv_transfer": result.cached_tokens,
                "local_compute": None if result.prompt_tokens is None or result.cached_tokens is None
                else result.prompt_tokens - result.cached_tokens}
        rows.append({**request_row(doc_id, prefill[doc_id], serve.index, result, hits), "level": level.name,
                     "due_s": due})
    return rows, started, finished, window, times


def load_level(plan: Plan, workload: list[dict], prefill: dict[int, int], cfg: dict, log_dir: Path,
               disks: list[str], level, servers: list[PoolServer] | None = None, out_dir: Path | None = None):
    """One load level: a fresh fleet on the restored pool, the drop checked again right before the
    first request, every follow-up to a replica that did not prefill its document, sent at ``level``
    (the ``peer`` level: by vLLM's own client, its files in ``out_dir``). An lmcache-mp cell's level
    starts fresh servers on the restored L2 folder, as its reuse does, unless ``servers`` (a memory
    pool's, re-populated for the level) run already."""
    route = followup_route(prefill, len(plan.replicas))
    commands = times = None
    with timed_fleet(plan, cfg, log_dir, servers) as fleet:
        drop = drop_pool(fleet.plan, cfg["drop_caches"])
        with fleet.window(f"load~{level.name}", disks):
            if level.kind == "peer":
                rows, started, finished, window, commands = replay_with_vllm_bench(
                    fleet.plan, fleet.replicas, workload, route, prefill, cfg, log_dir, out_dir, level.order)
            else:
                rows, started, finished, window, times = asyncio.run(_load(fleet.replicas, workload, route,
                                                                           prefill, cfg, level))
    # the level's own span (its schedule, or vLLM's client's requests), narrower than the sampled window
    result = fleet.result(records.frame(LevelRecord, rows), level=level.name, drop_before_level=drop,
                          wall_s=finished - started, started_at=started, finished_at=finished,
                          window_external_tokens=window)
    if commands is not None:
        result.meta["commands"] = commands
    if times is not None:
        result.meta["window_times"] = times
    return result
