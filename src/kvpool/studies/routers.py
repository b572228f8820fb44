"""Routers compared: where a fleet sends each request of a document, with and without a shared pool.

A router unit (``results/cells/<cell>/router~<name>/``) runs one fleet on a fresh, empty pool of the
cell's kind and sends every request through one router:

- ``first``: each document's first request (its prefill), in document order;
- ``follow-up``: each document's follow-up once, in a seeded shuffled order, after the pool was
  synced and dropped from the page cache;
- ``hot`` (``routers.hot.requests`` > 0): follow-ups drawn from a seeded Zipf law over the documents
  (a few documents take most requests), ``routers.hot.concurrency`` in flight;
- ``after-loss`` (``routers.lose_replica``): the last replica is stopped, the router forgets it, and
  each document's follow-up is sent once more.

The routers: ``cross`` sends a follow-up to the replica after the one that served the document's first
request (Study A's; never the same one); ``round-robin`` cycles over the live replicas; ``random``
draws one (seeded); ``prefix-affinity`` sends every request of a document to the same replica by
rendezvous hashing of the document's tokens, so losing a replica moves only that replica's documents.

Every request's tokens are attributed to where they came from: the serving replica's own prefix cache
(``local_cache_hit``), the pool (``external_kv_transfer``), or computed (``local_compute``), from the
serving replica's ``/metrics`` around it (one request in flight) or, in the hot phase, the responses'
``cached_tokens`` checked against the serving replicas' counters over the phase.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import random as random_module
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm

from kvpool.cells import Arm, Cell, run_pools
from kvpool.engine import prompts
from kvpool.engine.client import RequestResult, new_session
from kvpool.engine.cross_router import next_replica, round_robin
from kvpool.engine.plan import batch_invariant
from kvpool.engine.plan_types import Plan
from kvpool.engine.processes import Replica
from kvpool.measure import provenance, records, validity
from kvpool.measure.checks import check, verdict
from kvpool.measure.files import read_json
from kvpool.measure.records import RoutedRecord, read_records
from kvpool.measure.timed import (
    counter_window,
    drop_pool,
    landed_stores,
    measured_request,
    request_row,
    scrape_serving,
    timed_fleet,
    write_unit,
)
from kvpool.measure.unit import UnitPaths, run_unit
from kvpool.measure.unit_plan import checked_ports, new_plan, unit_pool
from kvpool.settings import PHASE_SETTINGS, reads
from kvpool.stats import reported_percentile
from kvpool.studies.load import Level, outputs_check, send_level

ROUTERS = ("cross", "round-robin", "random", "prefix-affinity")
PHASES = ("first", "follow-up", "hot", "after-loss")
SOURCES = ("local_cache_hit", "external_kv_transfer", "local_compute")


class Router:
    """One routing policy over a fleet's live replicas. ``first`` places a document's first request,
    ``followup`` any later one; ``lose`` removes a replica that stopped."""

    def __init__(self, name: str, replicas: list[int], seed: int):
        if name not in ROUTERS:
            raise ValueError(f"router {name!r} is not one of {', '.join(ROUTERS)}")
        self.name, self.live, self.placed = name, list(replicas), {}
        self._turn = itertools.count()
        self._rng = random_module.Random(seed)

    def lose(self, replica: int) -> None:
        if len(self.live) < 2:
            raise ValueError("a router needs a replica left after a loss")
        self.live.remove(replica)

    def first(self, doc_id: int, tokens: list[int]) -> int:
        if self.name == "cross":  # Study A's populate: round robin in arrival order
            replica = round_robin(next(self._turn), self.live)
        else:
            replica = self._pick(tokens)
        self.placed[doc_id] = replica
        return replica

    def followup(self, doc_id: int, tokens: list[int]) -> int:
        if self.name == "cross":  # Study A's follow-up: the next live replica after the one that prefilled it
            return next_replica(self.placed[doc_id], self.live)
        return self._pick(tokens)

    def _pick(self, tokens: list[int]) -> int:
        if self.name == "round-robin":
            return round_robin(next(self._turn), self.live)
        if self.name == "random":
            return self._rng.choice(self.live)
        return max(self.live, key=lambda replica: rendezvous_weight(tokens, replica))


def rendezvous_weight(tokens: list[int], replica: int) -> int:
    """Highest-random-weight hashing: each (document, replica) pair gets a fixed pseudo-random weight and
    a document goes to its heaviest live replica, so removing one moves only the documents it held."""
    digest = hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes() + replica.to_bytes(4, "little")).digest()
    return int.from_bytes(digest[:8], "little")


def followup_order(doc_ids: list[int], seed: int) -> list[int]:
    order = list(doc_ids)
    random_module.Random(seed).shuffle(order)
    return order


def hot_draws(doc_ids: list[int], count: int, exponent: float, seed: int) -> list[int]:
    """``count`` documents drawn with Zipf weights 1/rank^exponent, ranks in a seeded order of the documents."""
    if count <= 0:
        return []
    ranked = followup_order(doc_ids, seed + 1)
    weights = 1.0 / np.arange(1, len(ranked) + 1) ** exponent
    picks = np.random.default_rng(seed).choice(len(ranked), size=count, p=weights / weights.sum())
    return [ranked[i] for i in picks]


def phase_sources(rows: pd.DataFrame, window: dict[str, int] | None) -> dict[str, int | None]:
    """The phase's prompt tokens by source: per request where each request's counters are its own,
    the window's counters in the hot phase (many requests in flight)."""
    if window is not None:
        return {source: window.get(source) for source in SOURCES}
    columns = {"local_cache_hit": "local_cache_hit_tokens", "external_kv_transfer": "external_hit_tokens",
               "local_compute": "local_compute_tokens"}
    return {source: int(rows[column].fillna(0).sum()) for source, column in columns.items()}


def checks(arm: str, rows: pd.DataFrame, windows: dict[str, dict], drop: dict, loss: dict | None, doc_tokens: int,
           min_hit_fraction: float, max_resident_fraction: float, reference: pd.DataFrame | None = None,
           batch_invariant: bool = False, hot_in_flight: int = 1) -> dict:
    """A router unit's gate. Zero errors; every token attributed (per request, or the hot phase's
    responses against its window); reads cold after the drop; where a request lands on a replica that
    had never served its document, a shared pool must deliver the document and an isolated one must
    deliver nothing; the stopped replica served nothing after it was lost; every follow-up's answer
    equal to the split-matched recompute (``reference``: a document's first request reads no cache and
    is not compared; the hot phase's answers only under batch-invariant kernels)."""
    failed = rows[rows["error"].fillna("") != ""]
    result = {"zero_errors": check(failed.empty, len(failed), 0)}
    single = rows[rows["phase"] != "hot"]
    missing = int(single["external_hit_tokens"].isna().sum() + single["local_cache_hit_tokens"].isna().sum())
    agree = True
    for phase, window in windows.items():
        sent = rows[rows["phase"] == phase]
        cached = int(sent["cached_tokens"].fillna(0).sum())
        agree &= cached == window["local_cache_hit"] + window["external_kv_transfer"]
    result["hit_attribution"] = check(missing == 0 and agree, {"unattributed_requests": missing,
                                                               "windows_agree": agree}, "every token attributed")
    result["cold_reads"] = validity.cold_reads(drop, max_resident_fraction)
    moved = single[(~single["seen_before"].astype(bool)) & (single["phase"] != "first")]
    pooled = moved["external_hit_tokens"].fillna(0) / doc_tokens
    if arm == Arm.SHARED:
        worst = float(pooled.min()) if len(pooled) else None
        result["pool_hits"] = check(worst is None or worst >= min_hit_fraction, worst, min_hit_fraction)
    else:
        loaded = int(moved["external_hit_tokens"].fillna(0).sum())
        result["isolation"] = check(loaded == 0, loaded, 0)
    if loss is not None:
        after = rows[rows["phase"] == "after-loss"]
        served = int((after["serve_replica"] == loss["replica"]).sum())
        result["replica_lost"] = check(loss["stopped"] and served == 0,
                                       {"stopped": loss["stopped"], "served_after": served},
                                       "stopped, and served nothing after")
    hot = rows[rows["phase"] == "hot"]
    compared = rows[rows["phase"].isin(["follow-up", "after-loss"] + (["hot"] if batch_invariant else []))]
    result["output_matches_recompute"] = validity.outputs_check(compared, reference)
    if len(hot) and not batch_invariant:
        result["hot_outputs_match_recompute"] = outputs_check(hot, reference, hot_in_flight, False)
    return {"valid": verdict(result), "checks": result}


GROUPS = ("moved", "stayed")  # a request served by a replica new to its document, or by one that had served it


def groups(rows: pd.DataFrame, phase: str) -> list[tuple[str, pd.DataFrame]]:
    """A phase's requests as its table rows show them: all of them, then, where a phase sent requests one
    at a time both to replicas new to their document and to replicas that had served it, each group on
    its own (their TTFTs are two populations, own-cache hits and reloads or recomputes, and a median
    over both can fall between them)."""
    found = [("all", rows)]
    if phase != "hot":  # the hot phase's sources are its window's, not one per request
        seen = rows["seen_before"].astype(bool)
        parts = [("moved", rows[~seen]), ("stayed", rows[seen])]
        if all(len(part) for _, part in parts):
            found += parts
    return found


def phase_row(cell, router: str, phase: str, rows: pd.DataFrame, sources: dict, valid: bool, seed: int = 0,
              group: str = "all") -> dict:
    """One line of results/routers.csv: a router's phase in one cell (``group``: all its requests, or those
    served by a replica new to their document, ``moved``, or one that had served it, ``stayed``)."""
    ok = rows[rows["error"].fillna("") == ""]
    ttft = ok["ttft_s"].astype(float).to_numpy()
    p50, p99 = reported_percentile(ttft, 50, seed=seed), reported_percentile(ttft, 99, seed=seed)
    total = sum(v for v in sources.values() if v is not None) or np.nan
    per_replica = rows["serve_replica"].value_counts()
    return {
        **cell.keys(),
        "router": router, "phase": phase, "group": group, "valid": valid, "requests": len(rows), "ttft_n": len(ttft),
        "ttft_p50_s": p50["value"], "ttft_p50_ci_low_s": p50["ci_low"], "ttft_p50_ci_high_s": p50["ci_high"],
        "ttft_p99_s": p99["value"], "ttft_p99_basis": p99["basis"],
        "local_cache_fraction": (sources["local_cache_hit"] or 0) / total,
        "pool_fraction": (sources["external_kv_transfer"] or 0) / total,
        "computed_fraction": (sources["local_compute"] or 0) / total,
        "moved_fraction": float((~rows["seen_before"].astype(bool)).mean()) if len(rows) else np.nan,
        "max_replica_share": float(per_replica.max() / len(rows)) if len(rows) else np.nan,
        "errors": len(rows) - len(ok),
    }


def table(units: list[tuple[Cell, str]], csvs: list[str], metas: list[str]) -> pd.DataFrame:
    """results/routers.csv from the units' records (``csvs``) and run.json (``metas``): per cell, router,
    phase and group (``groups``), a ``phase_row``."""
    rows = []
    for (cell, router), csv, meta_path in zip(units, csvs, metas, strict=True):
        frame, meta = read_records(csv), read_json(meta_path)
        for phase in PHASES:
            sent = frame[frame["phase"] == phase]
            if sent.empty:
                continue
            for group, part in groups(sent, phase):
                sources = phase_sources(part, meta["windows"].get(phase) if group == "all" else None)
                rows.append(phase_row(cell, router, phase, part, sources, meta["valid"], group=group))
    return pd.DataFrame(rows)


log = logging.getLogger(__name__)


def router_pool_root(config: dict, cell: Cell, router: str) -> Path:
    """A router unit's own pool folder in the cell's tier (each unit starts it empty)."""
    return run_pools(config, cell.tier) / "routers" / cell.name / f"router~{router}"


@reads(*PHASE_SETTINGS, "routers", "min_hit_fraction", "max_resident_fraction", "hash_keys", "lmcache",
       "random_model")
def run_router_unit(config: dict, cell: Cell, router: str, *, model: str, prompts_path: str, plan_out: str,
                    manifest_out: str, csv_out: str, json_out: str, drive_csv: str, power_csv: str, log_dir: str,
                    provenance_config: dict, reference_csv: str | None = None) -> None:
    """One router unit (kvpool.studies.routers): its own plan on a fresh pool of the cell's kind, one fleet, every
    request where the router sends it; the rows, the unit's gate and its telemetry summary."""

    unit_dir = Path(csv_out).parent
    root = router_pool_root(config, cell, router)
    plan = checked_ports(new_plan(config, cell, model, unit_dir, pool_root=root))
    workload = prompts.read_workload(Path(prompts_path))
    unit = run_unit(
        plan, lambda disks: router_unit(plan, workload, router, config, Path(log_dir), disks),
        UnitPaths(csv_out, json_out, drive_csv, power_csv, log_dir, plan_out, manifest_out), f"router-{router}",
        pool=unit_pool(config, root, plan),
        manifest=provenance.manifest(provenance_config, cell=cell.name, router=router))
    frame, meta = unit.frame, unit.meta
    gate = checks(cell.arm, frame, meta["windows"], meta["drop_before_followups"], meta["loss"],
                  config["workload"]["doc_tokens"], config["min_hit_fraction"], config["max_resident_fraction"],
                  read_records(reference_csv) if reference_csv else None, batch_invariant(config["engine"]),
                  config["routers"]["hot"]["concurrency"])
    meta.update(validity.with_served(gate, meta, config["engine"]["max_model_len"], cell.chunk))
    write_unit(meta, len(frame), drive_csv, power_csv, plan, json_out, f"{cell.name} router~{router}")


def _routed_row(router: str, phase: str, seq: int, doc_id: int, first: int | None, serve: Replica, seen: bool,
                result: RequestResult, counts: dict[str, int] | None) -> dict:
    counts = counts or {}
    row = request_row(doc_id, first, serve.index, result, counts)
    row.update(router=router, phase=phase, seq=seq, first_replica=row.pop("prefill_replica"), seen_before=seen,
               local_cache_hit_tokens=counts.get("local_cache_hit"))
    return row


async def _routed_one_at_a_time(by_index: dict[int, Replica], router, phase: str, sends: list[tuple[int, list[int]]],
                                tokens: dict[int, list[int]], seen: dict[int, set[int]], cfg: dict) -> list[dict]:
    """Requests ``sends`` (doc_id, prompt) one at a time, each where the router sends it, with the serving
    replica's counter deltas around it."""
    output_tokens, timeout_s = cfg["workload"]["output_tokens"], cfg["engine"]["request_timeout_s"]
    rows = []
    async with new_session() as session:
        for seq, (doc_id, prompt) in enumerate(tqdm(sends, desc=f"{router.name} {phase}", unit="request")):
            place = router.first if phase == "first" else router.followup
            index = place(doc_id, tokens[doc_id])
            result, counts = await measured_request(session, by_index[index], prompt, output_tokens, timeout_s)
            rows.append(_routed_row(router.name, phase, seq, doc_id, router.placed.get(doc_id), by_index[index],
                                    index in seen[doc_id], result, counts))
            seen[doc_id].add(index)
    return rows


async def _routed_hot(by_index: dict[int, Replica], router, sends: list[tuple[int, list[int]]],
                      tokens: dict[int, list[int]], seen: dict[int, set[int]], cfg: dict, in_flight: int):
    """The hot phase: ``in_flight`` requests at a time; per request only its response's ``cached_tokens``
    (own cache and pool together), the split by source from the serving replicas' counters over the phase."""
    output_tokens, timeout_s = cfg["workload"]["output_tokens"], cfg["engine"]["request_timeout_s"]
    placed = [(doc_id, router.followup(doc_id, tokens[doc_id]), prompt) for doc_id, prompt in sends]
    seen_then = []
    for doc_id, index, _ in placed:  # in send order: a hot document's second request finds its first
        seen_then.append(index in seen[doc_id])
        seen[doc_id].add(index)
    serving = sorted({index for _, index, _ in placed})
    async with new_session() as session:
        before = await scrape_serving(session, by_index, serving)
        sent = await send_level(session, Level("concurrency", in_flight),
                                [(doc_id, by_index[index].url, prompt) for doc_id, index, prompt in placed],
                                output_tokens, timeout_s, in_flight, 1.0, 0)
        after = await scrape_serving(session, by_index, serving)
    window = {source: counter_window(before, after, source) for source in SOURCES}
    rows = [_routed_row(router.name, "hot", seq, doc_id, router.placed.get(doc_id), by_index[index], was_seen, result,
                        None)
            for seq, ((doc_id, index, _), was_seen, (_, _, result)) in enumerate(zip(placed, seen_then, sent,
                                                                                       strict=True))]
    return rows, window


def router_unit(plan: Plan, workload: list[dict], router_name: str, cfg: dict, log_dir: Path, disks: list[str]):
    """A router unit (kvpool.studies.routers): one fleet on a fresh pool; each document's first request, the
    pool dropped from the page cache and checked, every follow-up, the hot phase, then a replica stopped
    and every follow-up again, each request where ``router_name`` sends it."""
    settings = cfg["routers"]
    tokens = {item["doc_id"]: item["document"] for item in workload}
    followups = {item["doc_id"]: item["followup"] for item in workload}
    doc_ids = [item["doc_id"] for item in workload]
    seen: dict[int, set[int]] = defaultdict(set)
    windows, loss = {}, None
    with timed_fleet(plan, cfg, log_dir) as fleet:
        replicas, by_index = fleet.replicas, fleet.by_index
        router = Router(router_name, sorted(by_index), settings["seed"])
        with fleet.window(f"router~{router_name}", disks):
            rows = asyncio.run(_routed_one_at_a_time(by_index, router, "first",
                                                     [(d, tokens[d]) for d in doc_ids], tokens, seen, cfg))
            landed = landed_stores(fleet.plan, cfg, whole_workload=True)  # vllm-fs: every document's chunks
            drop = drop_pool(fleet.plan, cfg["drop_caches"])
            order = followup_order(doc_ids, settings["seed"])
            rows += asyncio.run(_routed_one_at_a_time(by_index, router, "follow-up",
                                                      [(d, followups[d]) for d in order], tokens, seen, cfg))
            hot = settings["hot"]
            if hot["requests"]:
                draws = hot_draws(doc_ids, hot["requests"], hot["zipf_exponent"], settings["seed"])
                hot_rows, windows["hot"] = asyncio.run(_routed_hot(
                    by_index, router, [(d, followups[d]) for d in draws], tokens, seen, cfg, hot["concurrency"]))
                rows += hot_rows
            if settings["lose_replica"]:
                lost = replicas[-1]
                lost.stop()
                loss = {"replica": lost.index, "stopped": not lost.alive(), "at": time.time()}
                log.info("%s: replica %d stopped; %s routes around it", plan.cell, lost.index, router_name)
                router.lose(lost.index)
                order = followup_order(doc_ids, settings["seed"] + 1)
                rows += asyncio.run(_routed_one_at_a_time(by_index, router, "after-loss",
                                                          [(d, followups[d]) for d in order], tokens, seen, cfg))
    landed = {} if landed is None else {"stores_landed": landed}
    return fleet.result(records.frame(RoutedRecord, rows), router=router_name, drop_before_followups=drop,
                        windows=windows, loss=loss, **landed)
