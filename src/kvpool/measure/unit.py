"""One timed unit's entry, the same for every sampled unit kind: its plan and manifest written, its pool
around it, its measurement (kvpool.measure.timed.timed_fleet) sampled by telemetry, the pool writes that
failed in it found in its logs, and its records archived and written; what it measured comes back as one
``UnitResult``."""

from __future__ import annotations

import dataclasses
import logging
from contextlib import nullcontext
from pathlib import Path

import pandas as pd

from kvpool.engine import metrics
from kvpool.engine.plan import plan_pool_dirs
from kvpool.engine.plan_types import Plan, write_plan
from kvpool.engine.processes import this_start
from kvpool.measure import logs, records
from kvpool.measure.drive import block_devices, drive_health
from kvpool.measure.files import write_json
from kvpool.measure.telemetry import Sampler

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class UnitPaths:
    """Where one timed unit's files go: its request records (``csv``, archived under ``runs/`` too), its
    meta data and gate (``json``), its window's drive and power samples, its replicas' logs and, for a unit
    that plans a fleet of its own, its plan and manifest."""

    csv: str
    json: str
    drive_csv: str
    power_csv: str
    log_dir: str
    plan: str | None = None
    manifest: str | None = None


@dataclasses.dataclass
class UnitResult:
    """What one timed unit measured, whatever its kind (a phase, a load level, a router, capacity or length
    unit, a Study B block): its request records, its meta data (the window's times, what each replica
    served, the pool servers' record; the telemetry and the unit's checks are added to it) and its window's
    sampler (None where the window was not sampled)."""

    frame: pd.DataFrame
    meta: dict
    sampler: Sampler | None = None


def run_unit(plan: Plan, measure, paths: UnitPaths, name: str, *, pool=None, manifest: dict | None = None
             ) -> UnitResult:
    """Every sampled unit kind's entry: its plan and ``manifest`` written where ``paths`` names them, then
    ``measure(disks)`` (a UnitResult from a ``timed_fleet``) with telemetry, inside ``pool`` (a unit's
    own pool, removed however the unit ends: kvpool.measure.unit_plan.unit_pool), and its records
    archived under ``runs/`` and written to ``paths.csv`` as ``name``."""
    if paths.plan is not None:
        write_plan(plan, paths.plan)
    if paths.manifest is not None:
        write_json(paths.manifest, manifest)
    with pool if pool is not None else nullcontext():
        result = _sampled(plan, measure, paths)
    records.write_records(result.frame, paths.csv, name)
    return result


def tier_disks(plan: Plan) -> tuple[list[str], list[dict]]:
    """The whole disks behind a plan's pool directories, and how each directory resolved."""
    resolved = [block_devices(d) for d in dict.fromkeys(plan_pool_dirs(plan))]
    return sorted({disk for record in resolved for disk in record["disks"]}), resolved


def _sampled(plan: Plan, measure, paths: UnitPaths) -> UnitResult:
    """One timed unit with telemetry; drive health recorded before and after it, and the pool writes that
    failed in it (a full tier shows only in the replicas' and servers' logs)."""
    disks, resolved = tier_disks(plan)
    health_before = [drive_health(d) for d in disks]
    log_start = logs.log_sizes(Path(paths.log_dir))
    result = measure(disks)
    result.frame = with_retrievals(result.frame, Path(paths.log_dir))
    meta = result.meta
    meta["pool_write_errors"] = logs.new_lines_matching(Path(paths.log_dir), log_start)
    # a unit whose pool refuses stores by design (a capacity unit's sized filesystem) names what refuses them
    limit = meta.get("stores_refused_by")
    for line in meta["pool_write_errors"]:
        if limit:
            log.info("%s refused a store (its limit): %s", limit, line)
        else:
            log.error("a pool write failed (is the tier full?): %s", line)
    drive, power = result.sampler.frames()
    drive.to_csv(paths.drive_csv, index=False)
    power.to_csv(paths.power_csv, index=False)
    meta["telemetry"] = {**result.sampler.meta, "devices": resolved, "health_before": health_before,
                         "health_after": [drive_health(d) for d in disks]}
    return result


def with_retrievals(frame: pd.DataFrame, log_dir: Path) -> pd.DataFrame:
    """``frame`` with each request's LMCache retrieve (tokens and seconds) from its replicas' logs in
    ``log_dir`` (their last start's section), matched by the completion's id; left empty where nothing was
    logged (a backend whose LMCache runs in a server of its own, a request that loaded nothing, a record
    without ids)."""
    if frame.empty or "request_id" not in frame:
        return frame
    found: dict[str, dict] = {}
    for path in sorted(Path(log_dir).glob("replica-*.log")):
        found.update(metrics.lmcache_retrievals(this_start(path.read_text(errors="replace"))))
    frame = frame.copy()
    for column in ("retrieved_tokens", "retrieve_s"):
        frame[column] = frame["request_id"].map(lambda rid, column=column: (found.get(rid) or {}).get(column))
    return frame
