"""Pool capacity as a dimension: how big must the shared pool be, under a popularity-skewed workload.

Per shared ``lmcache-redis``, ``lmcache-mp`` (memory tier) or ``lmcache-fs`` cell and per fraction in
``capacity.fractions``, one unit ``results/cells/<cell>/capacity~<fraction>/`` on a fleet and a pool of its
own. The capacity is ``fraction`` of the working set's KV bytes (every document's follow-up prompt in whole
chunks), set as the pool's own limit:

- Redis: populate with no limit (the pool whole, as the server holds it), then the server's ``maxmemory``
  set to its overhead while empty plus the capacity, with ``capacity.policy`` as its ``maxmemory-policy``;
  Redis evicts down to it at once;
- LMCache's MP server: its L1 (``--l1-size-gb``) is the capacity from the start, so populate already
  evicts. LMCache evicts on a 1 s timer once L1 is 80% full (its ``--eviction-trigger-watermark``), so
  the pool holds less than its L1 between ticks, and a store that finds L1 full is dropped;
- a pool of files (``lmcache-fs``): a filesystem of the capacity's size mounted over the pool folder
  (``kvpool.engine.sized_pool``: a tmpfs on a memory tier, an ext4 image through a loop device on a drive
  tier; root only). Nothing is evicted: once it is full a store fails, and the pool holds what landed.

Then ``capacity.warmup_requests`` and ``capacity.requests`` follow-ups, their documents drawn with a
seeded Zipf popularity (``capacity.popularity_exponent``; 0: uniform) over a seeded ranking, each sent
alone to a replica that did not prefill its document, whose own prefix cache is emptied first
(``capacity.reset_own_cache``), so the pool or a recompute serves it.

Each request's source is read from the serving replica's counters (pool, own cache, partial, recomputed),
and the server's evictions (Redis's ``evicted_keys``, the MP server's evicted L1 chunks) around it. A
recompute where the server evicted nothing since the document was last stored is a silent miss. A pool
of files is read directly: the chunk files each document's populate left are its own, and a recompute
while every one of them is in the pool is a silent miss. The unit's gate fails on a silent miss, as on
any error, and on a pool that held more KV bytes than its capacity.

An MP server on a drive tier is refused: its L2 folder has no limit here.

Each backend's view of its pool is kvpool.engine.pool_views; the draws and the request driver are
kvpool.studies.capacity_requests; the page and its figure kvpool.report.capacity.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path

import numpy as np
import pandas as pd
import psutil

from kvpool.cells import Arm, Cell, run_pools, tier_root
from kvpool.engine import external, prompts, sized_pool
from kvpool.engine.backends import REGISTRY, configured, lmcache_fs, pool_backend
from kvpool.engine.backends.base import FOLDER, SERVER
from kvpool.engine.model import engine_pool_bytes_per_token
from kvpool.engine.plan import plan_gpus
from kvpool.engine.plan_types import Plan
from kvpool.engine.pool_files import is_memory_backed
from kvpool.engine.pool_views import FilePool, pool_of, sized_pool_folder
from kvpool.matrix import cells as matrix_cells
from kvpool.matrix import is_memory_pool
from kvpool.measure import legacy, provenance, records
from kvpool.measure.checks import check, verdict
from kvpool.measure.files import read_json
from kvpool.measure.records import CapacityRecord, read_records
from kvpool.measure.timed import timed_fleet, write_unit
from kvpool.measure.unit import UnitPaths, run_unit
from kvpool.measure.unit_plan import checked_ports, new_plan, unit_pool
from kvpool.measure.validity import with_served
from kvpool.settings import PHASE_SETTINGS, pool_sections, reads
from kvpool.stats import mean_ci, proportion_ci, reported_percentile
from kvpool.studies.capacity_requests import Asking, draws, request_energy

log = logging.getLogger(__name__)

FILE_POLICY = lmcache_fs.FILE_POLICY  # a pool of files evicts nothing
FILE_REFUSALS = lmcache_fs.BACKEND.capacity.refuses

COLUMNS = ["cell", "backend", "chunk", "tier", "fraction", "policy", "valid", "requests", "errors", "hit_rate",
           "hit_rate_low", "hit_rate_high", "recomputed", "silent_misses", "evicted_keys", "capacity_bytes",
           "held_kv_bytes", "ttft_p50_s", "ttft_p50_ci_low_s", "ttft_p50_ci_high_s", "ttft_mean_s",
           "ttft_mean_ci_low_s", "ttft_mean_ci_high_s", "ttft_p99_s", "mean_power_w", "energy_per_request_j",
           "energy_per_request_ci_low_j", "energy_per_request_ci_high_j", "energy_basis",
           "recompute_ttft_p50_s", "recompute_ttft_mean_s", "recomputes_measured", "capacity_for_90pct_gain"]
GAIN_SHARE = 0.9  # the operator's number: the capacity at which the pool gives this share of its full gain


def fractions(config: dict) -> list[float]:
    return [float(f) for f in config["capacity"]["fractions"]]


def unit_label(fraction: float) -> str:
    return f"{fraction:g}"


def cells(config: dict) -> list[Cell]:
    """The shared cells whose pool can be given a size limit: a server's memory (a Redis server, an MP
    server's L1 on a memory tier), or a folder of files on a filesystem of the capacity's size."""
    return [cell for cell in matrix_cells(config) if cell.arm == Arm.SHARED and limit_kind(config, cell) is not None]


def limit_kind(config: dict, cell: Cell) -> str | None:
    """How ``cell``'s pool is limited (its backend's ``Capacity.kind``: a server's memory or a sized folder), or
    None where it cannot be (a server pool's files on a drive tier, a backend with no capacity)."""
    capacity = pool_backend(cell.backend).capacity
    if capacity is None or (capacity.kind == SERVER and not is_memory_pool(config, cell)):
        return None
    return capacity.kind


def units(config: dict) -> list[tuple[Cell, float]]:
    return [(cell, fraction) for cell in cells(config) for fraction in fractions(config)]


def working_set_tokens(config: dict, chunk: int) -> int:
    """The KV tokens the pool would hold with nothing evicted: every document's follow-up prompt (the
    document and its question) in whole chunks, what LMCache stores of it."""
    workload = config["workload"]
    return workload["documents"] * ((workload["doc_tokens"] + workload["followup_tokens"]) // chunk * chunk)


def capacity_bytes(config: dict, chunk: int, fraction: float, per_token: int) -> int:
    return int(fraction * working_set_tokens(config, chunk) * per_token)


def problems(config: dict, check_host: bool = True) -> list[str]:
    """What keeps the configured capacities from running, each naming the setting and the numbers.
    ``check_host=False`` skips what only the machine that runs the units can answer (its RAM), so a GPU
    server's config parses, and its committed run is re-read, on a smaller machine."""
    asked = fractions(config)
    if not asked:
        return []
    found, limited = _label_problems(asked), cells(config)
    if not limited:
        limitable = ", ".join(name for name, pool in REGISTRY.items() if pool.capacity is not None)
        refusals = "; ".join(f"{pool.name}: {pool.capacity_refusal}" for pool in configured(config)
                             if pool.capacity_refusal)
        found.append(f"capacity.fractions needs a shared cell whose pool can be limited ({limitable}: a server's "
                     f"memory or a pool of files on a sized folder); {refusals or 'the matrix has no shared cell'}")
    if external.is_external(config):
        found.append("capacity.fractions needs kvpool's own fleet and pool server (it limits the server and empties "
                     "the replicas' caches): an external fleet's pool is not kvpool's to limit")
    if config["replicas"] < 2:
        found.append("capacity.fractions needs two replicas or more (every follow-up goes to a replica that did not "
                     "prefill its document)")
    per_token = engine_pool_bytes_per_token(config)
    if per_token is None:
        found.append(f"capacity.fractions needs the bytes a pool holds per token of the model, and "
                     f"{config['engine']['model']} has no config.json here to read them from")
        return found
    workload = config["workload"]
    for chunk in sorted({cell.chunk for cell in limited}):
        document = (workload["doc_tokens"] + workload["followup_tokens"]) // chunk * chunk * per_token
        total = capacity_bytes(config, chunk, 1.0, per_token)
        small = [f for f in asked if f * total < document]
        if small:
            found.append(f"capacity.fractions {small} give a pool smaller than one document's KV at chunk {chunk} "
                         f"({min(small) * total:,.0f} bytes of the working set's {total:,} bytes; one document's "
                         f"follow-up prompt holds {document:,}): no document could be served from it")
    return found + (host_problems(config, limited, asked, per_token) if check_host else [])


def _label_problems(asked: list[float]) -> list[str]:
    """Each capacity names a unit of its own (``capacity~<label>``) whose label reads back as that capacity: a
    unit reads its fraction from its path, so two that print alike would be one unit, measured once."""
    found, labels = [], {}
    for fraction in asked:
        label = unit_label(fraction)
        if label in labels:
            found.append(f"capacity.fractions {labels[label]} and {fraction} both name the unit capacity~{label}: "
                         "give fractions that differ in their first six significant digits")
        elif float(label) != fraction:
            found.append(f"capacity.fractions {fraction} names the unit capacity~{label}, which measures "
                         f"{float(label)}: give at most six significant digits")
        labels.setdefault(label, fraction)
    return found


def host_problems(config: dict, limited: list[Cell], asked: list[float], per_token: int) -> list[str]:
    """What this host lacks for the units: the RAM a server's pool or a tmpfs pool takes, the free space a
    drive tier's sized pool needs, root and the tools to mount a pool of files."""
    found = []
    files = {cell.tier: tier_root(config, cell.tier) for cell in limited if limit_kind(config, cell) == FOLDER}
    if files:
        found += sized_pool.problems(files)
    # a Redis server holds the whole working set once (populate runs with no limit), an MP server's L1 and a
    # pool of files are the capacity from the start; a pool of files on a drive tier takes the tier's space,
    # which config's tier check counts with the tier's other pools (drive_tier_images)
    ram = psutil.virtual_memory().total
    for cell in limited:
        whole = capacity_bytes(config, cell.chunk, 1.0, per_token)
        largest = max(asked) * whole
        if limit_kind(config, cell) == FOLDER and not is_memory_backed(files[cell.tier]):
            continue
        held, when = ((whole, "is populated whole into the Redis server's memory before the cap")
                      if pool_backend(cell.backend).capacity.capped_after_populate else
                      (largest, f"at capacity {max(asked):g} is {pool_backend(cell.backend).capacity.held_in}")
                      if limit_kind(config, cell) == SERVER else
                      (largest, f"at capacity {max(asked):g} is a tmpfs on tier {cell.tier} (host RAM)"))
        if held > ram / 2:
            found.append(f"capacity.fractions: the working set's KV ({held:,.0f} bytes) {when}, and this host has "
                         f"{ram:,} bytes of RAM (at most half may go to the pool): fewer or shorter documents "
                         "(workload), or smaller capacities")
            break
    return found


def drive_tier_images(config: dict, tier: str) -> list[int]:
    """The bytes a capacity unit's pool of files takes on drive tier ``tier`` at the largest capacity: its
    ext4 image (the capacity, ext4's metadata and the filler), one per shared file cell there; the image
    goes with its unit, so the tier holds one at a time. A memory tier's pool is a tmpfs of host RAM."""
    asked, per_token = fractions(config), engine_pool_bytes_per_token(config)
    root = tier_root(config, tier)
    if not asked or per_token is None or is_memory_backed(root):
        return []
    return [sized_pool.image_bytes(capacity_bytes(config, cell.chunk, max(asked), per_token))
            for cell in cells(config) if limit_kind(config, cell) == FOLDER and cell.tier == tier]


def source(row: dict, doc_tokens: int, min_hit_fraction: float) -> str | None:
    """Where a follow-up's document came from, by the serving replica's counters: the pool, its own cache,
    partly the pool, or recomputed. None for a failed request (an error's text; a row read back from its CSV
    has NaN where there was none)."""
    error = row.get("error")
    if isinstance(error, str) and error:
        return None
    needed = min_hit_fraction * doc_tokens
    external, local = row.get("external_hit_tokens") or 0, row.get("local_cache_hit_tokens") or 0
    if external >= needed:
        return "pool"
    if local >= needed:
        return "own cache"
    return "partial" if external > 0 else "recomputed"


def account(rows: list[dict], doc_tokens: int, min_hit_fraction: float, stored: dict[int, int]) -> list[dict]:
    """Each follow-up's source, and its silent miss: a document not served from the pool although the pool
    held it. A pool of files says so itself (``held_before``: every chunk file the document's populate left
    was there as the follow-up was sent). A server's pool is judged by its evictions: nothing evicted since
    the document's last store began (``stored``: each document's eviction count as populate began storing
    it, ``store_marks``; a follow-up that recomputed its document stored it again, and the evictions during
    that store may have taken its own chunks, so they count as since). Rows in the order they were sent."""
    stored_at = dict(stored)
    accounted = []
    for row in rows:
        found = source(row, doc_tokens, min_hit_fraction)
        held = row.get("held_before")
        if held is None or pd.isna(held):
            held = row["evicted_before"] - stored_at[row["doc_id"]] == 0
        silent = found in ("partial", "recomputed") and bool(held)
        if found in ("partial", "recomputed"):  # the serving replica stored the recomputed chunks again
            stored_at[row["doc_id"]] = row["evicted_before"]
        accounted.append({**row, "source": found, "silent_miss": silent if found is not None else None})
    return accounted


def held_kv_bytes(pool: dict) -> int:
    """The most KV the limited server held, of what was read (a unit's ``pool`` record): right after the
    cap, at the end, and the most any read saw while the limit held (``peak_kv_bytes``: an MP server's
    every read, from populate on; units recorded before it have none)."""
    return max(pool["capped"]["kv_bytes"], pool["end"]["kv_bytes"], legacy.capacity_pool(pool)["peak_kv_bytes"])


def silent_misses(rows: pd.DataFrame) -> int:
    return int(rows["silent_miss"].fillna(False).astype(bool).sum())


def drawn(frame: pd.DataFrame) -> pd.DataFrame:
    """A unit's drawn follow-ups, warm-up and window: the rows its gate judges, and its table's silent misses
    count (a pool too small for its working set misses silently in the warm-up too)."""
    return frame[frame["part"] != "populate"]


def unit_checks(frame: pd.DataFrame, held_kv_bytes: int, limit_bytes: int) -> dict:
    """A capacity unit's gate: no errors, every follow-up cross-replica, no silent miss, and the pool never
    held more KV than its capacity (after the cap and at the end)."""
    asked = drawn(frame)
    errors = int((frame["error"].fillna("") != "").sum())
    cross = asked["prefill_replica"] != asked["serve_replica"]
    silent = silent_misses(asked)
    return {"zero_errors": check(errors == 0, errors, 0),
            "cross_replica": check(bool(len(asked)) and bool(cross.all()),
                                   float(cross.mean()) if len(asked) else 0.0, 1.0),
            "no_silent_miss": check(silent == 0, silent, 0),
            "held_within_capacity": check(held_kv_bytes <= limit_bytes, held_kv_bytes, limit_bytes)}


def _unit_sections(config: dict, wildcards=None) -> dict:
    """A unit reads its own fraction from its path, not capacity.fractions: a new fraction leaves the measured
    units as they are. An MP unit reads its server's settings too."""
    found = {"capacity": {key: value for key, value in config["capacity"].items() if key != "fractions"}}
    if wildcards is not None:
        cell = Cell.from_wildcards(wildcards)
        found.update(pool_sections(config, [pool_backend(cell.backend)]))
    return found


def limited_config(config: dict, cell: Cell, limit: int) -> dict:
    """The config a unit's plan is made from, its pool limited to ``limit`` bytes where the backend sets the limit
    at the start (an MP server's L1); a Redis server is capped after populate, so its config is as it was."""
    return pool_backend(cell.backend).capacity_config(config, cell, limit)


def eviction_policy(config: dict, cell: Cell) -> str:
    """The pool's eviction policy: Redis's ``maxmemory-policy`` (``capacity.policy``), the MP server's
    ``--eviction-policy`` (``lmcache_mp.eviction_policy``), or none for a pool of files."""
    return pool_backend(cell.backend).eviction_policy(config)


@reads(*PHASE_SETTINGS, "min_hit_fraction", "hash_keys", "lmcache", "lmcache_redis", "random_model",
       picked=_unit_sections)
def run_capacity_unit(config: dict, cell: Cell, fraction: float, *, model: str, prompts_path: str, plan_out: str,
                      manifest_out: str, csv_out: str, json_out: str, drive_csv: str, power_csv: str, log_dir: str,
                      provenance_config: dict) -> None:
    """One capacity unit (kvpool.studies.capacity): its own plan, server and fleet; populate, the cap, the
    drawn follow-ups; the rows, the unit's gate and its telemetry summary."""
    per_token = engine_pool_bytes_per_token(config)
    limit = capacity_bytes(config, cell.chunk, fraction, per_token)
    root = run_pools(config, cell.tier) / "capacity" / cell.name / f"capacity~{unit_label(fraction)}"
    settings = config["capacity"]
    plan = checked_ports(new_plan(limited_config(config, cell, limit), cell, model, Path(csv_out).parent,
                                  pool_root=root,
                                  dev_mode=settings["reset_own_cache"],
                                  load_failure_policy=settings["kv_load_failure_policy"]))
    workload = prompts.read_workload(Path(prompts_path))
    if limit_kind(config, cell) == FOLDER:
        sized_pool.release_stale(root)
    paths = UnitPaths(csv_out, json_out, drive_csv, power_csv, log_dir, plan_out, manifest_out)
    unit = run_unit(
        plan, lambda disks: capacity_unit(plan, workload, config, limit, eviction_policy(config, cell), Path(log_dir),
                                          disks, doc_chunks=config["workload"]["doc_tokens"] // cell.chunk),
        paths, f"capacity-{unit_label(fraction)}", pool=unit_pool(config, root, plan),
        manifest=provenance.manifest(provenance_config, cell=cell.name, capacity=fraction))
    frame, meta = unit.frame, unit.meta
    checks = unit_checks(frame, held_kv_bytes(meta["pool"]), limit)
    gate = with_served({"checks": checks, "valid": verdict(checks)}, meta, config["engine"]["max_model_len"],
                       cell.chunk)
    meta.update(fraction=fraction, capacity_bytes=limit, **gate)
    asked = frame[frame["part"] == "window"]
    log.info("%s capacity~%s: %d of %d follow-ups from the pool, %d recomputed, %d keys evicted, %d silent misses",
             cell.name, unit_label(fraction), int((asked["source"] == "pool").sum()), len(asked),
             int((asked["source"] == "recomputed").sum()), meta["pool"]["end"]["evicted_keys"],
             silent_misses(drawn(frame)))
    write_unit(meta, len(asked), drive_csv, power_csv, plan, json_out, f"{cell.name} capacity~{unit_label(fraction)}")


def capacity_unit(plan: Plan, workload: list[dict], cfg: dict, limit: int, policy: str, log_dir: Path,
                  disks: list[str], doc_chunks: int = 0):
    """Populate, the pool's limit at ``limit`` KV bytes (set now on Redis; at its start on an MP server, and
    on a pool of files, whose folder is a filesystem of that size) with its eviction ``policy``, the
    warm-up, then the window of drawn follow-ups, one at a time, its drives and power sampled. Returns the
    rows, the meta data (the pool's state at each point, the limit as set, and for a pool of files the
    documents it held whole after populate) and the sampler. ``doc_chunks``: a document's whole chunks."""
    settings = cfg["capacity"]
    sequence = draws(len(workload), settings["popularity_exponent"],
                     settings["warmup_requests"] + settings["requests"], settings["seed"])
    with (sized_pool_folder(plan, limit) as sized, timed_fleet(plan, cfg, log_dir) as fleet,
          request_energy(plan_gpus(plan)) as energy):
        with pool_of(fleet.servers, sized, doc_chunks) as pool:
            ask = Asking(fleet.replicas, workload, cfg, pool, energy)
            empty = pool.state()
            populated = asyncio.run(ask.populate())
            whole = [doc_id for doc_id in ask.by_doc if pool.holds(doc_id)]
            limits = pool.limit(empty, limit, policy)
            capped = pool.state()
            warmup = settings["warmup_requests"]
            asked = asyncio.run(ask.followups(sequence[:warmup], "warmup", 0, settings["reset_own_cache"]))
            with fleet.window("capacity", disks):
                asked += asyncio.run(ask.followups(sequence[warmup:], "window", warmup, settings["reset_own_cache"]))
            end = pool.state()
    stored = store_marks(ask.populated, populated["evicted_keys"])
    rows = ask.populated + account(asked, cfg["workload"]["doc_tokens"], cfg["min_hit_fraction"], stored)
    pool_record = {"empty": empty, "populated": populated, **limits, "capped": capped, "end": end,
                   "peak_kv_bytes": pool.peak_kv_bytes}
    refused = {}
    if isinstance(pool, FilePool):
        pool_record["documents_whole"] = sorted(whole)
        refused = {"stores_refused_by": pool.refuses}  # its limit at work, not a fault
    return fleet.result(records.frame(CapacityRecord, rows), pool=pool_record, policy=limits["policy"], **refused,
                        popularity_exponent=settings["popularity_exponent"],
                        kv_load_failure_policy=settings["kv_load_failure_policy"] or "vLLM's default",
                        warmup_requests=warmup, window_requests=len(sequence) - warmup)


def store_marks(populated: list[dict], default: int) -> dict[int, int]:
    """Each document's eviction count as populate began storing it (its populate row's ``evicted_before``),
    or ``default`` where the row has none (units recorded before populate read it: populate ran with no
    limit, so nothing was evicted before its end)."""
    return {row["doc_id"]: legacy.evicted_before(row, default) for row in populated}



def unit_row(cell: Cell, fraction: float, frame: pd.DataFrame, meta: dict) -> dict:
    """One unit's window: its failed requests, the answered ones' hit rate (Wilson 95% interval), recomputes,
    silent misses (the warm-up's too, as its gate counts them), evictions, the bytes it held against its
    capacity, TTFT p50 and mean (bootstrap intervals) and p99, power and energy."""
    asked = frame[frame["part"] == "window"]
    window = asked[asked["error"].fillna("") == ""]
    hits = int((window["source"] == "pool").sum())
    hit_low, hit_high = proportion_ci(hits, len(window))
    ttft = window["ttft_s"].astype(float)
    p50, p99 = reported_percentile(ttft, 50), reported_percentile(ttft, 99)
    mean_low, mean_high = mean_ci(ttft)
    power = (meta.get("summary") or {}).get("power") or {}
    return {**cell.keys(arm=False), "fraction": fraction,
            "policy": meta["policy"], "valid": bool(meta["valid"]), "requests": len(window),
            "errors": len(asked) - len(window),
            "hit_rate": hits / len(window) if len(window) else np.nan,
            "hit_rate_low": hit_low, "hit_rate_high": hit_high,
            "recomputed": int(window["source"].isin(["recomputed", "partial"]).sum()),
            "silent_misses": silent_misses(drawn(frame)),  # the gate's count, from the same rows
            "evicted_keys": meta["pool"]["end"]["evicted_keys"], "capacity_bytes": meta["capacity_bytes"],
            "held_kv_bytes": held_kv_bytes(meta["pool"]),
            "ttft_p50_s": p50["value"], "ttft_p50_ci_low_s": p50["ci_low"], "ttft_p50_ci_high_s": p50["ci_high"],
            "ttft_mean_s": float(ttft.mean()) if len(ttft) else np.nan, "ttft_mean_ci_low_s": mean_low,
            "ttft_mean_ci_high_s": mean_high, "ttft_p99_s": p99["value"], "mean_power_w": power.get("mean_power_w"),
            **follow_up_energy(window, power)}


ENERGY_BASES = {"request": "each follow-up's own GPU energy (NVML's counter around it)",
                "window": "the window's GPU energy over its follow-ups, the waits between them included"}


def follow_up_energy(window: pd.DataFrame, power: dict) -> dict:
    """Energy per follow-up: the mean of each answered follow-up's own GPU energy (bootstrap interval),
    where the unit read it; else the window's energy over its follow-ups, which includes the waits for the
    server's evictions between requests (units recorded before requests read their own), with no
    interval; none without a GPU counter."""

    own = legacy.capacity_requests(window)["gpu_energy_j"].astype(float).dropna()
    if len(own):
        low, high = mean_ci(own)
        return {"energy_per_request_j": float(own.mean()), "energy_per_request_ci_low_j": low,
                "energy_per_request_ci_high_j": high, "energy_basis": "request"}
    whole = power.get("energy_per_request_j")
    return {"energy_per_request_j": whole, "energy_per_request_ci_low_j": np.nan,
            "energy_per_request_ci_high_j": np.nan, "energy_basis": "window" if whole is not None else "none"}


def capacity_for_gain(points: pd.DataFrame, recompute_s: float, share: float = GAIN_SHARE) -> float:
    """The smallest capacity (fraction) at which mean TTFT has come down by ``share`` of the way from the
    recompute (``recompute_s``, its mean) to its value at the largest capacity, linearly interpolated
    between the measured capacities (``points``: fraction, ttft_mean_s of the valid units). The mean, not
    the median: a window of hits and recomputes is two modes, and its median jumps from one to the other
    once half are hits, however many still recompute. NaN without a unit at 1.0 or more, without a
    measured recompute, or where the pool gains nothing at the largest capacity."""
    points = points.sort_values("fraction")
    if points.empty or points["fraction"].iloc[-1] < 1.0 or not np.isfinite(recompute_s):
        return np.nan
    full = points["ttft_mean_s"].iloc[-1]
    if full >= recompute_s:
        return np.nan
    target = recompute_s - share * (recompute_s - full)
    fractions, ttft = points["fraction"].to_numpy(), points["ttft_mean_s"].to_numpy()
    if ttft[0] <= target:
        return float(fractions[0])
    for (f0, t0), (f1, t1) in itertools.pairwise(zip(fractions, ttft, strict=True)):
        if t1 <= target < t0:
            return float(f0 + (t0 - target) / (t0 - t1) * (f1 - f0))
    return np.nan


def with_gain(table: pd.DataFrame, recomputed: dict[str, np.ndarray]) -> pd.DataFrame:
    """Per cell, the recompute's TTFT p50 and mean (every recomputed follow-up of its units' windows:
    ``recomputed``) and the capacity at which its pool gives 90% of its full-capacity gain in mean TTFT
    (``capacity_for_gain``)."""
    parts = []
    for name, cell in table.groupby("cell", sort=False):
        own = recomputed.get(name, np.array([]))
        median, mean = (float(np.median(own)), float(np.mean(own))) if len(own) else (np.nan, np.nan)
        at = capacity_for_gain(cell[cell["valid"]], mean)
        parts.append(cell.assign(recompute_ttft_p50_s=median, recompute_ttft_mean_s=mean,
                                 recomputes_measured=len(own), capacity_for_90pct_gain=at))
    return pd.concat(parts, ignore_index=True) if parts else table


def table(units: list[tuple[Cell, float]], csvs: list[str], metas: list[str]) -> pd.DataFrame:
    """results/capacity.csv from the units' records (``csvs``, ``metas``): per shared cell and capacity, the
    window's hit rate, recomputes, silent misses, evictions, bytes held, TTFT and energy, with the
    recompute's TTFT and the capacity for 90% of the gain (``with_gain``)."""
    rows, recomputed = [], {}
    for (cell, fraction), csv, meta in zip(units, csvs, metas, strict=True):
        frame = read_records(csv)
        rows.append(unit_row(cell, fraction, frame, read_json(meta)))
        window = frame[(frame["part"] == "window") & (frame["source"] == "recomputed")]
        recomputed[cell.name] = np.concatenate([recomputed.get(cell.name, np.array([])),
                                                window["ttft_s"].astype(float).to_numpy()])
    shown = with_gain(pd.DataFrame(rows).sort_values(["cell", "fraction"], kind="stable"), recomputed)
    return shown.reindex(columns=COLUMNS)
