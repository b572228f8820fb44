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

import hashlib
import itertools
import random as random_module

import numpy as np
import pandas as pd

from kvpool import validity
from kvpool.checks import check, verdict
from kvpool.load import outputs_check
from kvpool.summary import reported_percentile

ROUTERS = ("cross", "round-robin", "random", "prefix-affinity")
PHASES = ("first", "follow-up", "hot", "after-loss")
SOURCES = ("local_cache_hit", "external_kv_transfer", "local_compute")
COLUMNS = ["router", "phase", "seq", "doc_id", "first_replica", "serve_replica", "seen_before", "ttft_s", "e2e_s",
           "prompt_tokens", "cached_tokens", "local_cache_hit_tokens", "external_hit_tokens", "local_compute_tokens",
           "output_text", "error"]


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
            replica = self.live[next(self._turn) % len(self.live)]
        else:
            replica = self._pick(tokens)
        self.placed[doc_id] = replica
        return replica

    def followup(self, doc_id: int, tokens: list[int]) -> int:
        if self.name == "cross":  # the next live replica after the one that prefilled it
            first = self.placed[doc_id]
            later = [r for r in self.live if r > first] + [r for r in self.live if r < first]
            return later[0] if later else first
        return self._pick(tokens)

    def _pick(self, tokens: list[int]) -> int:
        if self.name == "round-robin":
            return self.live[next(self._turn) % len(self.live)]
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
    if arm == "shared":
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
        "cell": cell.name, "backend": cell.backend, "arm": cell.arm, "chunk": cell.chunk, "tier": cell.tier,
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


def markdown(table: pd.DataFrame) -> str:
    """results/routers.md: TTFT and where the prompt tokens came from, per cell, router, phase and group."""
    lines = ["# Routers: where each request went and where its tokens came from", "",
             "A phase's requests that went to a replica new to their document (moved) and to one that had served it "
             "(stayed) are also shown apart: their TTFTs are two populations.", "",
             "| cell | router | phase | requests | gate | n | TTFT p50 [95% CI] | TTFT p99 | own cache | pool "
             "| computed | on a replica new to the document | busiest replica's share |", "|" + "---|" * 13]
    for row in table.itertuples():
        group = getattr(row, "group", "all")
        p99 = f"{row.ttft_p99_s:.3g} s"
        basis = getattr(row, "ttft_p99_basis", "p99")
        if isinstance(basis, str) and basis.startswith("max of"):
            p99 = f"{basis}: {p99}"
        interval = (f" [{row.ttft_p50_ci_low_s:.3g}, {row.ttft_p50_ci_high_s:.3g}]"
                    if pd.notna(row.ttft_p50_ci_low_s) else "")
        lines.append(
            f"| {row.backend} / {row.arm} / chunk {row.chunk} / {row.tier} | {row.router} | {row.phase} | "
            f"{'all' if group == 'all' else group} | {'valid' if row.valid else '**INVALID**'} | "
            f"{getattr(row, 'ttft_n', row.requests)} | {row.ttft_p50_s:.3g} s{interval} | {p99} | "
            f"{row.local_cache_fraction:.0%} | {row.pool_fraction:.0%} | {row.computed_fraction:.0%} | "
            f"{row.moved_fraction:.0%} | {row.max_replica_share:.0%} |")
    return "\n".join(lines) + "\n"
