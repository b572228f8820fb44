"""A production trace replayed (issue 50): how much of a real fleet's reusable prefill a pool recovers.

A trace unit (``results/cells/<cell>/trace~<router>/``) scales the configured trace (kvpool.traces: a time
window, whole prefix groups, ``block_tokens`` per block, a speed-up, an output cap), starts one fleet on a fresh
pool of the cell's kind and sends every kept request once, one at a time in trace order and never before its
scaled arrival, to the replica the router picks (``round-robin``, ``random``, or ``prefix-affinity`` on the
request's first ``group_blocks`` blocks). The cell's arm is the pool: ``shared``, ``isolated`` or ``off`` (no
KV connector: vLLM's own prefix cache alone).

Per request it records where its prompt tokens came from (the serving replica's own cache, the pool, computed:
its ``/metrics`` around it) beside the trace's own bound: the whole blocks an earlier request's prompt had
(``bound_tokens``: one unbounded cache for the fleet, the most a shared pool could serve) and the same under the
router's placement (``placed_bound_tokens``: one cache per replica, the most isolated pools or own caches could).

The gate: no error; every token attributed; in the shared arm no silent miss (a request served less than its
bound, as far as the pool's chunks and vLLM's last computed token allow, while the pool evicted nothing); in the
isolated and off arms nothing served beyond what the serving replica's own history allows (and nothing from a
pool when off); a seeded sample of requests that reused a prefix answered as a pool-less recompute of the
same prompt in the same split. Reloads are not forced cold: a trace has no pause to drop the page cache in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging
import random
import time
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm

from kvpool import matrix, traces
from kvpool.cells import Arm, Cell, run_pools
from kvpool.engine import external
from kvpool.engine import model as engine_model
from kvpool.engine.client import new_session
from kvpool.engine.plan import plan_pool_dirs
from kvpool.engine.plan_types import Plan
from kvpool.engine.pool_files import pool_files
from kvpool.engine.pool_views import MPPool
from kvpool.engine.processes import Replica
from kvpool.measure import provenance, records
from kvpool.measure import reference as split_reference
from kvpool.measure.checks import check, not_applicable, not_verified, verdict
from kvpool.measure.files import read_json
from kvpool.measure.records import TraceRecord, read_records
from kvpool.measure.timed import measured_request, recompute_in_splits, stores_landing, timed_fleet, write_unit
from kvpool.measure.unit import UnitPaths, run_unit
from kvpool.measure.unit_plan import checked_ports, new_plan, unit_pool
from kvpool.measure.validity import with_served
from kvpool.settings import PHASE_SETTINGS, reads
from kvpool.stats import proportion_ci, reported_percentile
from kvpool.studies.routers import Router

ARMS = (Arm.SHARED.value, Arm.ISOLATED.value, Arm.OFF.value)
ROUTERS = ("round-robin", "random", "prefix-affinity")
VLLM_BLOCK = 16  # vLLM's own prefix cache holds whole blocks of this many tokens

log = logging.getLogger(__name__)


def scaling(config: dict) -> traces.Scaling:
    settings = config["trace"]
    return traces.Scaling(window_s=tuple(settings["window_s"]), groups=settings["groups"],
                          group_blocks=settings["group_blocks"], block_tokens=settings["block_tokens"],
                          speedup=settings["speedup"], max_output_tokens=settings["max_output_tokens"],
                          seed=settings["seed"])


def units(config: dict) -> list[tuple[Cell, str]]:
    """Every trace unit: per cell of the matrix's shared arm (its backend, chunk and tier) one cell per arm in
    ``trace.arms`` (the off arm once per chunk and tier: it has no pool to tell backends apart), per router."""
    settings = config["trace"]
    if not settings["arms"]:
        return []
    found: dict[str, Cell] = {}
    for cell in matrix.cells({**config, "arms": [Arm.SHARED.value]}):
        for arm in settings["arms"]:
            if arm == Arm.OFF and any(c.arm == Arm.OFF and (c.chunk, c.tier) == (cell.chunk, cell.tier)
                                      for c in found.values()):
                continue
            unit = dataclasses.replace(cell, arm=arm)
            found.setdefault(unit.name, unit)
    return [(cell, router) for cell in found.values() for router in settings["routers"]]


def problems(config: dict, check_paths: bool = True) -> list[str]:
    """Why the trace units cannot run as configured, each naming the key (none when ``trace.arms`` is empty)."""
    settings = config["trace"]
    if not settings["arms"]:
        return []
    found = []
    if external.is_external(config):
        found.append("trace.arms with fleet.mode external: a trace unit starts a fleet of its own on a fresh pool")
    start, end = settings["window_s"]
    if end <= start:
        found.append(f"trace.window_s: the window [{start}, {end}] s ends before it starts")
    if not settings["routers"]:
        found.append("trace.routers is empty: a trace unit needs a router (round-robin, random, prefix-affinity)")
    for chunk in config["chunk_sizes"]:
        if settings["block_tokens"] % chunk:
            found.append(f"trace.block_tokens {settings['block_tokens']} is not a multiple of chunk size {chunk}: "
                         "a pool serves whole chunks, so the trace's reuse bound would count tokens no pool can serve")
    if settings["block_tokens"] % VLLM_BLOCK:
        found.append(f"trace.block_tokens {settings['block_tokens']} is not a multiple of vLLM's {VLLM_BLOCK}-token "
                     "blocks")
    if check_paths and not found:
        path = trace_file(config)
        if not path.is_file():
            found.append(f"trace.path {settings['path']}: no such file")
        else:
            try:
                kept, _ = replayed(config, trace_requests(config))
            except ValueError as exc:
                found.append(f"trace.path: {exc}")
            else:
                if not kept:
                    found.append(f"trace: no request of {settings['path']} fits trace.window_s {settings['window_s']}"
                                 f" and trace.groups {settings['groups']} within engine.max_model_len")
    return found


def trace_file(config: dict) -> Path:
    """``trace.path``: from the working directory, or the repository's where only it has the file (the shipped
    trace, for a run in another directory)."""
    path = Path(config["trace"]["path"])
    if path.is_absolute() or path.exists():
        return path
    return provenance.REPO / path if (provenance.REPO / path).exists() else path


def trace_requests(config: dict) -> list[traces.TraceRequest]:
    """The configured trace's requests, read once per file as it is on disk: the checks at start (``problems``, the
    tier's room) and a unit read the same file."""
    path = trace_file(config)
    stat = path.stat()
    return list(_read_trace(str(path), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=4)
def _read_trace(path: str, mtime_ns: int, size: int) -> tuple[traces.TraceRequest, ...]:
    return tuple(traces.read_trace(path))


def replayed(config: dict, requests: list[traces.TraceRequest]) -> tuple[list[traces.ScaledRequest], int]:
    """The requests a unit sends (scaled, at most ``trace.max_requests``) and how many of the window's were left
    out because prompt and output would not fit ``engine.max_model_len``."""
    scaled = traces.scale(requests, scaling(config))
    limit = config["engine"]["max_model_len"]
    fitting = [request for request in scaled if request.prompt_tokens + request.output_tokens <= limit]
    too_long = len(scaled) - len(fitting)
    if config["trace"]["max_requests"]:
        fitting = fitting[:config["trace"]["max_requests"]]
    return fitting, too_long


def pool_bound_tokens(config: dict) -> int:
    """The most tokens of KV a trace unit's pool can hold: every sent prompt's once (a pool stores a chunk once
    per distinct prefix, and a prompt's chunks only where it computed them). 0 for a trace that cannot be read:
    ``problems`` names why."""
    try:
        sent, _ = replayed(config, trace_requests(config))
    except (OSError, ValueError):
        return 0
    return sum(request.prompt_tokens for request in sent)


def prompts(sent: list[traces.ScaledRequest], allowed: list[int], block_tokens: int, seed: int) -> list[list[int]]:
    """Each request's prompt in the model's usable token ids (kvpool.engine.model.vocabulary): equal block ids are
    equal tokens in every request."""
    return [[allowed[token] for token in traces.prompt_of(request, block_tokens, len(allowed), seed)]
            for request in sent]


def request_key(request: traces.ScaledRequest) -> str:
    return f"trace-{request.index}"


def servable(bound_tokens: int, prompt_tokens: int, chunk: int) -> int:
    """The most of a ``bound_tokens`` reusable prefix a cache can serve: vLLM computes a prompt's last token
    whatever it holds, and a pool serves whole chunks."""
    return min(bound_tokens, (prompt_tokens - 1) // chunk * chunk)


def server_pool(pool_server: dict | None) -> tuple[int | None, int | None]:
    """The pool servers' evicted chunks over the unit and their L1 bytes at its end, where every server's counters
    were read (LMCache's MP servers: ``kvpool.measure.timed.pool_servers``'s record)."""
    if not pool_server:
        return None, None
    records = [record for record in pool_server.values() if isinstance(record, dict)]
    servers = [record for record in records if not record.get("error") and record.get("metrics")]
    if len(servers) < len(records):
        return None, None
    evicted = [MPPool.evicted_in(record["metrics"]) for record in servers]
    held = [record.get("l1_bytes") for record in servers]
    return (int(sum(evicted)) if evicted and None not in evicted else None,
            int(sum(held)) if held and None not in held else None)


def served_tokens(rows: pd.DataFrame) -> pd.Series:
    return rows["local_cache_hit_tokens"].fillna(0) + rows["external_hit_tokens"].fillna(0)


def checks(arm: str, rows: pd.DataFrame, chunk: int, block_tokens: int, evicted: int | None,
           reference: pd.DataFrame | None) -> dict:
    """A trace unit's gate (the module's docstring says what each check holds)."""
    failed = rows[rows["error"].fillna("") != ""]
    ok = rows[rows["error"].fillna("") == ""]
    result = {"zero_errors": check(failed.empty, len(failed), 0, examples=list(failed["error"].head(3)))}
    missing = int(ok[["local_cache_hit_tokens", "external_hit_tokens", "local_compute_tokens"]].isna().any(axis=1)
                  .sum())
    result["hit_attribution"] = check(missing == 0, missing, "every request's tokens by source")
    served = served_tokens(ok)
    if arm == Arm.SHARED:
        due = np.array([servable(b, p, chunk) for b, p in zip(ok["bound_tokens"], ok["prompt_tokens"], strict=True)],
                       dtype=float)
        missed = (due - served.to_numpy()).clip(min=0)
        short = ok[missed > 0]
        value = {"requests": len(short), "tokens": int(missed.sum()), "evicted_chunks": evicted}
        examples = [f"{row.key}: {row.local_cache_hit_tokens + row.external_hit_tokens:.0f} of "
                    f"{row.bound_tokens} reusable tokens served" for row in short.head(3).itertuples()]
        if evicted:
            result["no_silent_miss"] = not_verified(f"the pool evicted {evicted} chunks: a shortfall may be an "
                                                    "eviction, not a silent miss", value, examples=examples)
        else:
            result["no_silent_miss"] = check(short.empty, value, "every request served its reusable prefix",
                                             examples=examples)
    else:
        allowed = ok["placed_bound_tokens"] + block_tokens - 1  # a tail block's cached part may match too
        beyond = ok[served > allowed]
        result["isolation"] = check(beyond.empty, len(beyond), "nothing beyond the serving replica's own history",
                                    examples=[f"{row.key}: {row.local_cache_hit_tokens + row.external_hit_tokens:.0f}"
                                              f" served, its replica had {row.placed_bound_tokens}"
                                              for row in beyond.head(3).itertuples()])
        if arm == Arm.OFF:
            pooled = int(ok["external_hit_tokens"].fillna(0).sum())
            result["no_pool"] = check(pooled == 0, pooled, 0)
    result["cold_reads"] = not_applicable("a trace replays its requests back to back, with no pause to drop the "
                                          "pool from the page cache in: a reload may be a page-cache read")
    sampled = ok[ok["sampled"].fillna(False).astype(bool)]
    if sampled.empty:
        result["output_matches_recompute"] = not_applicable("no request reused a prefix, so none was sampled")
    else:
        result["output_matches_recompute"] = split_reference.output_check(sampled, reference, "sampled request")
    return result


def sample(rows: pd.DataFrame, count: int, cap: int, seed: int) -> set[str]:
    """The answer check's seeded sample: ``count`` answered requests that reused a prefix and ran to the output
    cap (the reference computes every answer to one length)."""
    reused = rows[(rows["error"].fillna("") == "") & (served_tokens(rows) > 0) & (rows["output_tokens"] == cap)]
    keys = sorted(reused["key"])
    return set(random.Random(seed).sample(keys, min(count, len(keys))))


def _unit_sections(config: dict, wildcards=None) -> dict:
    return {"trace": {key: value for key, value in config["trace"].items() if key not in ("arms", "routers")}}


@reads(*PHASE_SETTINGS, "slo_s", "hash_keys", "lmcache", "random_model", picked=_unit_sections)
def run_trace_unit(config: dict, cell: Cell, router: str, *, model: str, plan_out: str, manifest_out: str,
                   csv_out: str, json_out: str, reference_out: str, drive_csv: str, power_csv: str, log_dir: str,
                   provenance_config: dict) -> None:
    """One trace unit: its own plan on a fresh pool of the cell's kind, one fleet, the scaled trace replayed
    through ``router``; the rows with their bounds, the sample's split-matched reference (``reference_out``),
    the unit's gate and its telemetry summary."""
    settings = config["trace"]
    sent, too_long = replayed(config, trace_requests(config))
    allowed = engine_model.vocabulary(model)
    texts = dict(zip(map(request_key, sent), prompts(sent, allowed, settings["block_tokens"], settings["seed"]),
                     strict=True))
    root = run_pools(config, cell.tier) / "traces" / cell.name / f"trace~{router}"
    plan = checked_ports(new_plan(config, cell, model, Path(csv_out).parent, pool_root=root))
    unit = run_unit(
        plan, lambda disks: trace_unit(plan, sent, texts, router, config, Path(log_dir), disks),
        UnitPaths(csv_out, json_out, drive_csv, power_csv, log_dir, plan_out, manifest_out), f"trace-{router}",
        pool=unit_pool(config, root, plan),
        manifest=provenance.manifest(provenance_config, cell=cell.name, router=router))
    frame, meta = unit.frame, unit.meta
    capped = {**config, "workload": {**config["workload"], "output_tokens": settings["max_output_tokens"]}}
    under_test = frame[frame["sampled"].fillna(False).astype(bool)]
    compared = recompute_in_splits(capped, model, under_test, {k: texts[k] for k in under_test["key"]},
                                   split_reference.normalized(None), Path(log_dir) / "reference")
    compared.to_csv(reference_out, index=False)
    evicted, server_bytes = server_pool(meta.get("pool_server"))
    found = checks(cell.arm, frame, cell.chunk, settings["block_tokens"], evicted, compared)
    gate = with_served({"checks": found, "valid": verdict(found)}, meta, config["engine"]["max_model_len"], cell.chunk)
    meta.update(router=router, scaling=dataclasses.asdict(scaling(config)), trace=settings["path"],
                trace_sha256=hashlib.sha256(trace_file(config).read_bytes()).hexdigest(),
                left_out_too_long=too_long, pool_evicted_chunks=evicted,
                pool_bytes_end=meta.pop("pool_bytes_end", None) or server_bytes, **gate)
    write_unit(meta, len(frame), drive_csv, power_csv, plan, json_out, f"{cell.name} trace~{router}")


async def _replay(by_index: dict[int, Replica], router: Router, sent: list[traces.ScaledRequest],
                  texts: dict[str, list[int]], cfg: dict, plan: Plan) -> list[dict]:
    """Every request one at a time in trace order, none before its scaled arrival, each where the router sends
    it, with the serving replica's counter deltas around it."""
    settings, timeout_s = cfg["trace"], cfg["engine"]["request_timeout_s"]
    head = settings["group_blocks"] * settings["block_tokens"]
    rows, start = [], time.monotonic()
    async with new_session() as session:
        for seq, request in enumerate(tqdm(sent, desc=f"trace {router.name}", unit="request")):
            wait = request.at_s - (time.monotonic() - start)
            if wait > 0:
                await asyncio.sleep(wait)
            key = request_key(request)
            index = router.followup(request.index, texts[key][:head])
            sent_s = time.monotonic() - start
            result, counts = await measured_request(session, by_index[index], texts[key], request.output_tokens,
                                                    timeout_s)
            # vllm-fs stores after the answer: the next request finds what this one stored (None elsewhere)
            landed = await stores_landing(plan, cfg)
            rows.append(records.row(
                TraceRecord, router=router.name, seq=seq, key=key, trace_index=request.index,
                group="-".join(map(str, traces.group_key(request, settings["group_blocks"]))),
                due_s=request.at_s, sent_s=sent_s, serve_replica=index, whole_blocks=request.whole_blocks,
                output_tokens=request.output_tokens, ttft_s=result.ttft_s, e2e_s=result.e2e_s,
                prompt_tokens=result.prompt_tokens, cached_tokens=result.cached_tokens,
                local_cache_hit_tokens=counts.get("local_cache_hit"),
                external_hit_tokens=counts.get("external_kv_transfer"),
                local_compute_tokens=counts.get("local_compute"), output_text=result.output_text,
                error=result.error, stores_waited_s=(landed or {}).get("waited_s")))
    return rows


def with_bounds(rows: list[dict], sent: list[traces.ScaledRequest], block_tokens: int) -> list[dict]:
    """The rows with each request's reuse bound in tokens: with one cache for the fleet, and one per replica
    under the placement the router made."""
    placement = [row["serve_replica"] for row in rows]
    fleet, placed = traces.reuse_bounds(sent), traces.reuse_bounds(sent, placement)
    return [{**row, "bound_tokens": b * block_tokens, "placed_bound_tokens": p * block_tokens}
            for row, b, p in zip(rows, fleet, placed, strict=True)]


def pool_bytes(plan: Plan) -> int | None:
    """The bytes in the plan's pool folders now (a pool of files only grows in a unit: its peak)."""
    dirs = plan_pool_dirs(plan)
    if not dirs:
        return None
    return sum(path.stat().st_size for path in pool_files(dirs))


def trace_unit(plan: Plan, sent: list[traces.ScaledRequest], texts: dict[str, list[int]], router_name: str,
               cfg: dict, log_dir: Path, disks: list[str]):
    """A trace unit's fleet on a fresh pool: the scaled trace replayed through ``router_name``."""
    settings = cfg["trace"]
    with timed_fleet(plan, cfg, log_dir) as fleet:
        router = Router(router_name, sorted(fleet.by_index), settings["seed"])
        with fleet.window(f"trace~{router_name}", disks):
            rows = asyncio.run(_replay(fleet.by_index, router, sent, texts, cfg, fleet.plan))
        held = None if fleet.servers else pool_bytes(fleet.plan)
    rows = with_bounds(rows, sent, settings["block_tokens"])
    frame = records.frame(TraceRecord, rows)
    picked = sample(frame, settings["answer_sample"], settings["max_output_tokens"], settings["seed"])
    frame["sampled"] = frame["key"].isin(picked)
    return fleet.result(frame, pool_bytes_end=held)


def unit_row(cell: Cell, router: str, frame: pd.DataFrame, meta: dict, slo_s: float, seed: int = 0) -> dict:
    """One line of results/trace.csv: a trace unit's reuse against the trace's bounds, its TTFT, goodput at the
    SLO, energy and pool."""
    ok = frame[frame["error"].fillna("") == ""]
    ttft = ok["ttft_s"].astype(float).to_numpy()
    p50, p95, p99 = (reported_percentile(ttft, q, seed=seed) for q in (50, 95, 99))
    served = served_tokens(ok)
    bound, placed = ok["bound_tokens"].astype(float), ok["placed_bound_tokens"].astype(float)
    within = np.minimum(served, bound)
    good = int((ttft <= slo_s).sum())
    low, high = proportion_ci(good, len(frame))
    power = meta.get("summary", {}).get("power", {})
    checked = meta["checks"].get("no_silent_miss", {}).get("value") or {}
    return {
        **cell.keys(), "router": router, "valid": meta["valid"], "requests": len(frame), "errors": len(frame) - len(ok),
        "left_out_too_long": meta.get("left_out_too_long"),
        "block_tokens": meta["scaling"]["block_tokens"], "window_s": "-".join(map(str, meta["scaling"]["window_s"])),
        "groups": meta["scaling"]["groups"], "speedup": meta["scaling"]["speedup"],
        "prompt_tokens": int(ok["prompt_tokens"].fillna(0).sum()),
        "bound_tokens": int(bound.sum()), "placed_bound_tokens": int(placed.sum()),
        "own_cache_tokens": int(ok["local_cache_hit_tokens"].fillna(0).sum()),
        "pool_tokens": int(ok["external_hit_tokens"].fillna(0).sum()),
        "computed_tokens": int(ok["local_compute_tokens"].fillna(0).sum()),
        "recovered_of_bound": float(within.sum() / bound.sum()) if bound.sum() else np.nan,
        "recovered_of_placed_bound": float(np.minimum(served, placed).sum() / placed.sum()) if placed.sum() else np.nan,
        "silent_misses": checked.get("requests"), "silent_miss_tokens": checked.get("tokens"),
        "ttft_n": len(ttft), "ttft_p50_s": p50["value"], "ttft_p50_ci_low_s": p50["ci_low"],
        "ttft_p50_ci_high_s": p50["ci_high"], "ttft_p95_s": p95["value"], "ttft_p99_s": p99["value"],
        "ttft_p99_basis": p99["basis"], "slo_s": slo_s, "slo_attainment": good / len(frame) if len(frame) else np.nan,
        "slo_ci_low": low, "slo_ci_high": high,
        "gpu_mean_power_w": power.get("mean_power_w"), "energy_per_request_j": power.get("energy_per_request_j"),
        "pool_bytes_end": meta.get("pool_bytes_end"), "pool_evicted_chunks": meta.get("pool_evicted_chunks"),
        "wall_s": meta.get("wall_s"),
    }


def table(units_: list[tuple[Cell, str]], csvs: list[str], metas: list[str], slo_s: float) -> pd.DataFrame:
    """results/trace.csv: one ``unit_row`` per trace unit."""
    return pd.DataFrame([unit_row(cell, router, read_records(csv), read_json(meta), slo_s)
                         for (cell, router), csv, meta in zip(units_, csvs, metas, strict=True)])
