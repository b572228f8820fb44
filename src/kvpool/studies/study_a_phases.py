"""Study A's two measured phases on a fleet: populate (after a preflight that replica 1 finds replica 0's
probe in a shared pool, and not in an isolated one) and reuse (every follow-up to a replica that did not
prefill its document). kvpool.studies.study_a runs them, sampled, and writes what they return."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from tqdm import tqdm

from kvpool.cells import Cell
from kvpool.engine import external
from kvpool.engine.backends import pool_backend
from kvpool.engine.client import complete, new_session
from kvpool.engine.cross_router import followup_route, populate_route
from kvpool.engine.plan import plan_pool_dirs
from kvpool.engine.plan_types import Plan
from kvpool.engine.pool_files import TEMP_SUFFIX, pool_files
from kvpool.engine.processes import PoolServer, Replica
from kvpool.measure import records
from kvpool.measure.records import RequestRecord
from kvpool.measure.reference import followups
from kvpool.measure.timed import (
    drop_pool,
    measured_request,
    request_row,
    reset_prefix_cache,
    settled_stores,
    timed_fleet,
)

log = logging.getLogger(__name__)


class PreflightFailed(RuntimeError):
    """Replicas of a shared pool cannot find each other's chunks or get different KV back (or an
    isolated arm finds them)."""


async def _preflight(session, replicas: list[Replica], probe: list[int], probe_followup: list[int],
                     output_tokens: int, timeout_s: float, expect_shared: bool, landed=None) -> dict:
    """Replica 0 stores a probe; replica 1 asks for its extension. Shared pools must hit, isolated must not.

    Replica 0 then answers the extension itself, on the probe's KV in its own GPU cache. The pool and
    that cache both cover the probe's two whole chunks, so a shared pool that returned the KV replica 0
    stored gives replica 1 the same greedy tokens; a pool that returns damaged KV is caught here,
    before the populate phase is spent. ``landed`` (a backend whose stores reach the pool's files after the
    answer: ``StoreWatch``) waits for the probe's chunks and records how many were there at the answer.
    """
    stored = await complete(session, replicas[0].url, probe, output_tokens, timeout_s)
    store = await asyncio.to_thread(landed) if landed is not None else None
    found, counts = await measured_request(session, replicas[1], probe_followup, output_tokens, timeout_s)
    local = await complete(session, replicas[0].url, probe_followup, output_tokens, timeout_s)
    hits = counts.get("external_kv_transfer", 0)
    errors = [e for e in (stored.error, found.error, local.error) if e]
    outputs_match = not errors and found.output_text == local.output_text
    # Only a pool hit puts the pool's KV under test; an isolated arm's replica 1 computes cold.
    ok = not errors and ((hits > 0 and outputs_match) if expect_shared else hits == 0)
    found = {"ok": ok, "expect_shared": expect_shared, "probe_tokens": len(probe), "hit_tokens": hits,
             "outputs_match": outputs_match, "pool_output": found.output_text, "local_output": local.output_text,
             "errors": errors}
    return found if store is None else {**found, "probe_store": store}


def preflight_failure(cell: str, preflight: dict) -> str:
    """Why a preflight failed, in one line."""
    if preflight["errors"]:
        return f"preflight failed for {cell}: a probe request failed: {'; '.join(preflight['errors'])}"
    if preflight["expect_shared"] and preflight["hit_tokens"] > 0 and not preflight.get("outputs_match", True):
        return (f"preflight failed for {cell}: replica 1 loaded {preflight['hit_tokens']} tokens of replica 0's "
                f"probe from the pool but answered {preflight['pool_output']!r}, while replica 0, on the probe's "
                f"KV in its own GPU cache, answered {preflight['local_output']!r}: the pool returned different KV "
                "than was stored (e.g. LMCache's in-process connector on vLLM 0.26, LMCache issue #4463)")
    expected = ("expected a hit: the pool is not shared" if preflight["expect_shared"]
                else "expected none: the arm is not isolated")
    return (f"preflight failed for {cell}: replica 1 loaded {preflight['hit_tokens']} of the "
            f"{preflight['probe_tokens']}-token probe replica 0 stored ({expected})")


class StoreWatch:
    """The probe's chunks landing in a pool of files that a backend stores to after the answer (vllm-fs): the
    chunk files (named ``*suffix``) whole at the answer (``at_answer``, counted at once) and the wait until
    ``chunks`` more are there. ``settled_chunks`` counts the pool's chunk files once its stores went quiet."""

    def __init__(self, dirs: list[Path], chunks: int, timeout_s: float, suffix: str = "", poll_s: float = 0.05):
        self.dirs, self.chunks, self.timeout_s, self.suffix, self.poll_s = dirs, chunks, timeout_s, suffix, poll_s
        self.before = self._whole()

    def _whole(self) -> int:
        return sum(1 for path in pool_files(self.dirs)
                   if path.name.endswith(self.suffix) and not path.name.endswith(TEMP_SUFFIX))

    def settled_chunks(self) -> int:
        """The pool's chunk files once two reads half a second apart agree (the preflight's own stores in)."""
        settled_stores(self.dirs, None, timeout_s=self.timeout_s)
        return self._whole()

    def __call__(self) -> dict:
        started = time.monotonic()
        at_answer = self._whole() - self.before
        now = at_answer
        while now < self.chunks and time.monotonic() - started < self.timeout_s:
            time.sleep(self.poll_s)
            now = self._whole() - self.before
        return {"chunks": self.chunks, "at_answer": at_answer, "landed": now,
                "waited_s": round(time.monotonic() - started, 3)}


async def _populate(replicas, workload, route, cfg, probe, expect_shared: bool,
                    landed: StoreWatch | None = None) -> tuple[list[dict], dict]:
    output_tokens, timeout_s = cfg["workload"]["output_tokens"], cfg["engine"]["request_timeout_s"]
    async with new_session() as session:
        preflight = await _preflight(session, replicas, *probe, output_tokens, timeout_s, expect_shared=expect_shared,
                                     landed=landed)
        log.info("preflight %s: replica 1 loaded %d tokens of the %d-token probe replica 0 stored (%s)",
                 "passed" if preflight["ok"] else "FAILED", preflight["hit_tokens"], preflight["probe_tokens"],
                 "a hit expected" if expect_shared else "none expected")
        if not preflight["ok"] and cfg["preflight_on_failure"] == "abort":
            return [], preflight
        if landed is not None:  # what the preflight stored, which populate's wait for the documents counts on top
            preflight["chunks_before_documents"] = await asyncio.to_thread(landed.settled_chunks)
        rows: list[dict] = []
        bar = tqdm(total=len(workload), desc="populate", unit="doc")

        async def feed(replica: Replica):
            # One request in flight per replica keeps each replica's counter deltas exact.
            for item in workload:
                if route[item["doc_id"]] != replica.index:
                    continue
                result, counts = await measured_request(session, replica, item["document"], output_tokens, timeout_s)
                rows.append(request_row(item["doc_id"], replica.index, replica.index, result, counts))
                bar.update()

        await asyncio.gather(*(feed(r) for r in replicas))
        bar.close()
    return sorted(rows, key=lambda r: r["doc_id"]), preflight


def populate_phase(plan: Plan, workload: list[dict], cfg: dict, probe: tuple[list[int], list[int]], log_dir: Path,
                   disks: list[str], servers: list[PoolServer] | None = None, *, expect_shared: bool,
                   replicas: list[Replica] | None = None):
    """Start the fleet (and its pool servers unless ``servers`` run already; none where the cell's one fleet
    runs, ``replicas``), run the preflight (replica 1 must find replica 0's probe when ``expect_shared``,
    must not otherwise), send each document once round robin, stop what it started.

    Returns the per-document records, the phase's meta data and its telemetry sampler.
    """
    route = populate_route([item["doc_id"] for item in workload], len(plan.replicas))
    with timed_fleet(plan, cfg, log_dir, servers, replicas) as fleet:
        # what an external fleet says of itself (kvpool's own replicas are in the plan and manifest)
        endpoints = [external.describe(r.url) for r in fleet.replicas] if plan.external else None
        cell = Cell.from_name(plan.cell)
        landed, backend = None, pool_backend(cell.backend)
        if backend.stores_after_answer and not plan.external and plan_pool_dirs(plan):
            settle = backend.populate_settle(cfg, cell)
            landed = StoreWatch(plan_pool_dirs(plan), len(probe[0]) // cell.chunk, settle["timeout_s"],
                                settle["chunk_suffix"])
        with fleet.window("populate", disks):
            rows, preflight = asyncio.run(_populate(fleet.replicas, workload, route, cfg, probe, expect_shared,
                                                    landed))
    if not preflight["ok"]:
        message = preflight_failure(plan.cell, preflight)
        if cfg["preflight_on_failure"] == "abort":
            raise PreflightFailed(message + "; set preflight_on_failure: record to measure the cell anyway")
        log.error(message)
    result = fleet.result(records.frame(RequestRecord, rows), preflight=preflight)
    if endpoints is not None:
        result.meta["endpoints"] = endpoints
    return result


async def _reuse(replicas, workload, route, prefill, cfg, between_reloads=None,
                 connector_tier: bool = False) -> tuple[list[dict], float, float]:
    output_tokens, timeout_s = cfg["workload"]["output_tokens"], cfg["engine"]["request_timeout_s"]
    by_index = {r.index: r for r in replicas}
    rows = []
    async with new_session() as session:
        started = time.time()
        with tqdm(total=sum(len(followups(item)) for item in workload), desc="reuse", unit="follow-up") as bar:
            for item in workload:
                serve = by_index[route[item["doc_id"]]]
                for number, prompt in enumerate(followups(item)):
                    reset = ""
                    if number:  # a reload again: nothing of the document left in the serving replica or warm
                        reset = await reset_prefix_cache(session, serve, connector=connector_tier)
                        if between_reloads is not None:  # runs whether or not the reset failed
                            emptied = await asyncio.to_thread(between_reloads)
                            reset = reset or emptied
                    result, counts = await measured_request(session, serve, prompt, output_tokens, timeout_s)
                    if reset and not result.error:
                        result.error = f"the reset before this follow-up failed: {reset}"
                    row = request_row(item["doc_id"], prefill[item["doc_id"]], serve.index, result, counts)
                    rows.append({**row, "followup": number})
                    bar.update()
        finished = time.time()
    return rows, started, finished


def reuse_phase(plan: Plan, workload: list[dict], prefill: dict[int, int], cfg: dict, log_dir: Path, disks: list[str],
                servers: list[PoolServer] | None = None, between_reloads=None, replicas: list[Replica] | None = None):
    """Start the fleet on the populated pool (an MP pool on a drive: a fresh server, its L1 empty), or use
    the cell's one fleet (``replicas``), drop the pool from the page cache again, send every follow-up to a
    replica that did not prefill its document, one at a time, and stop what it started. Before each of a
    document's later follow-ups the serving replica's prefix cache is emptied (and its connector's own tier, where
    the backend keeps one) and ``between_reloads`` runs (a pool of files restored and dropped again, an isolated
    arm's pool servers emptied): an error message, or ""."""
    route = followup_route(prefill, len(plan.replicas))
    with timed_fleet(plan, cfg, log_dir, servers, replicas) as fleet:
        # Starting the fleet may have touched the pool; the drop must hold right before the reads.
        drop = drop_pool(fleet.plan, cfg["drop_caches"])
        with fleet.window("reuse", disks):
            rows, started, finished = asyncio.run(_reuse(
                fleet.replicas, workload, route, prefill, cfg, between_reloads,
                connector_tier=pool_backend(Cell.from_name(plan.cell).backend).connector_tier))
    # the wall clock of the follow-ups themselves, from the first request to the last answer
    return fleet.result(records.frame(RequestRecord, rows), drop_before_reuse=drop, wall_s=finished - started,
                        started_at=started, finished_at=finished)
