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
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from kvpool import validity
from kvpool.checks import check, not_verified, verdict
from kvpool.client import RequestResult, complete
from kvpool.pool import pool_files

LEVEL_PATTERN = r"c[0-9]+|r[0-9]+(\.[0-9]+)?|peer"


@dataclass(frozen=True)
class Level:
    """A unit of a cell's load chain: ``concurrency`` (N in flight), ``rate`` (open-loop arrivals per
    second) or ``peer`` (vLLM's own client replaying the reuse phase one at a time, kvpool.peer)."""

    kind: str
    value: float

    @property
    def name(self) -> str:
        if self.kind == "peer":
            return "peer"
        if self.kind == "concurrency":
            return f"c{int(self.value)}"
        return f"r{self.value:g}"

    @classmethod
    def from_name(cls, name: str) -> Level:
        if name == "peer":
            return cls("peer", 1)
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


def load_chain(config: dict) -> list[Level]:
    """Every unit that runs on a cell's pool after its reuse phase, in run order: the peer replay of
    that phase first when ``peer.enabled``, then the load levels in config order, so that a level added
    later builds only itself. The last unit removes the pool when pools are not kept."""
    return ([Level("peer", 1)] if config["peer"]["enabled"] else []) + levels(config)


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


def restore_pool(dirs: list[Path], populate_digests: pd.DataFrame) -> dict:
    """Back to what populate left: remove every pool file populate did not store (an earlier level's
    serving replicas stored documents and follow-up chunks). What populate stored is left as it is;
    the level's gate checks it is unchanged."""
    kept = set(zip(populate_digests["copy"], populate_digests["key"], strict=True))
    removed = 0
    for directory in dict.fromkeys(map(Path, dirs)):
        for path in pool_files([directory]):
            if (directory.name, str(path.relative_to(directory))) not in kept:
                path.unlink()
                removed += 1
    return {"removed_files": removed, "kept_files": len(kept)}


def files_restored(unchanged: dict) -> dict:
    """The ``pool_restored`` check of a pool of files: populate's files unchanged (kvbytes.unchanged)."""
    return check(unchanged["changed"] == 0 and unchanged["missing"] == 0, unchanged, "populate's files unchanged")


def repopulated(cell_rows: pd.DataFrame, cell_meta: dict, rows: pd.DataFrame, meta: dict) -> dict:
    """What a memory pool's level populated (``rows``, ``meta``) against the cell's own populate:
    placement (document -> replica), errors, the preflight, and the bytes its servers held afterwards."""
    def placement(frame: pd.DataFrame) -> dict:
        return dict(zip(frame["doc_id"].astype(int), frame["prefill_replica"].astype(int), strict=True))

    return {"repopulated": True, "same_placement": placement(cell_rows) == placement(rows),
            "errors": int((rows["error"].fillna("") != "").sum()), "preflight_ok": bool(meta["preflight"]["ok"]),
            "bytes": int(meta["pool"]["bytes"]), "cell_bytes": int(cell_meta["pool"]["bytes"])}


def memory_restored(restored: dict) -> dict:
    """The ``pool_restored`` check of a memory pool populated again for its level (``repopulated``)."""
    ok = (restored["same_placement"] and restored["errors"] == 0 and restored["preflight_ok"]
          and restored["bytes"] == restored["cell_bytes"])
    return check(ok, restored, "populated again without errors, in the same placement, to the cell's pool bytes")


def request_checks(rows: pd.DataFrame) -> dict:
    """What every unit of the load chain asks of its requests: no errors, every follow-up cross-replica."""
    errors = int((rows["error"].fillna("") != "").sum())
    cross = rows["prefill_replica"] != rows["serve_replica"]
    return {"zero_errors": check(errors == 0, errors, 0),
            "cross_replica": check(bool(len(rows)) and bool(cross.all()), float(cross.mean()) if len(rows) else 0.0,
                                   1.0)}


def outputs_check(rows: pd.DataFrame, reference: pd.DataFrame | None, in_flight: int, batch_invariant: bool) -> dict:
    """A level's answers against the split-matched reference (kvpool.reference). With more than one
    request in flight the batch a request shares changes the kernels' numerics, so its answer is only
    comparable under vLLM's batch-invariant kernels; without them the check is not verified, and says why."""
    if in_flight > 1 and not batch_invariant:
        answered = int((rows["error"].fillna("") == "").sum())
        return not_verified(f"{answered} answers sent up to {in_flight} at a time: the batch each shared changes "
                            "the numerics, so they are not comparable with a recompute sent alone; "
                            "engine.batch_invariant: true (vLLM's batch-invariant kernels) makes them so",
                            {"answers": answered, "in_flight": in_flight})
    return validity.outputs_check(rows, reference)


def level_checks(arm: str, rows: pd.DataFrame, hits: dict, drop: dict, pool_restored: dict, doc_tokens: int,
                 min_hit_fraction: float, max_resident_fraction: float, outputs: dict | None = None) -> dict:
    """A level's gate: what the cell's gate asks of its reuse, on this level's requests, with its
    answers against the recompute (``outputs``: :func:`outputs_check`)."""
    fractions = rows["cached_tokens"].fillna(0).astype(float) / doc_tokens
    checks = {
        **request_checks(rows),
        "pool_restored": pool_restored,
        "hit_attribution": check(hits["agree"], hits, "the two sums equal"),
    }
    checks["cold_reads"] = validity.cold_reads(drop, max_resident_fraction)  # as the cell's gate
    if arm == "shared":
        worst = float(fractions.min()) if len(fractions) else 0.0
        checks["pool_hits"] = check(worst >= min_hit_fraction, worst, min_hit_fraction)
    else:
        loaded = int(rows["cached_tokens"].fillna(0).sum())
        checks["isolation"] = check(loaded == 0, loaded, 0)
    if outputs is not None:
        checks["output_matches_recompute"] = outputs
    return {"valid": verdict(checks), "checks": checks}
