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
from kvpool.summary import percentile_ci

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
           min_hit_fraction: float, max_resident_fraction: float) -> dict:
    """A router unit's gate. Zero errors; every token attributed (per request, or the hot phase's
    responses against its window); reads cold after the drop; where a request lands on a replica that
    had never served its document, a shared pool must deliver the document and an isolated one must
    deliver nothing; the stopped replica served nothing after it was lost."""
    failed = rows[rows["error"].fillna("") != ""]
    result = {"zero_errors": {"ok": failed.empty, "value": len(failed), "threshold": 0}}
    single = rows[rows["phase"] != "hot"]
    missing = int(single["external_hit_tokens"].isna().sum() + single["local_cache_hit_tokens"].isna().sum())
    agree = True
    for phase, window in windows.items():
        sent = rows[rows["phase"] == phase]
        cached = int(sent["cached_tokens"].fillna(0).sum())
        agree &= cached == window["local_cache_hit"] + window["external_kv_transfer"]
    result["hit_attribution"] = {"ok": missing == 0 and agree, "value": {"unattributed_requests": missing,
                                 "windows_agree": agree}, "threshold": "every token attributed"}
    result["cold_reads"] = validity.cold_reads(drop, max_resident_fraction)
    moved = single[(~single["seen_before"].astype(bool)) & (single["phase"] != "first")]
    pooled = moved["external_hit_tokens"].fillna(0) / doc_tokens
    if arm == "shared":
        worst = float(pooled.min()) if len(pooled) else None
        result["pool_hits"] = {"ok": worst is None or worst >= min_hit_fraction, "value": worst,
                               "threshold": min_hit_fraction}
    else:
        loaded = int(moved["external_hit_tokens"].fillna(0).sum())
        result["isolation"] = {"ok": loaded == 0, "value": loaded, "threshold": 0}
    if loss is not None:
        after = rows[rows["phase"] == "after-loss"]
        served = int((after["serve_replica"] == loss["replica"]).sum())
        result["replica_lost"] = {"ok": loss["stopped"] and served == 0,
                                  "value": {"stopped": loss["stopped"], "served_after": served},
                                  "threshold": "stopped, and served nothing after"}
    return {"valid": all(check["ok"] for check in result.values()), "checks": result}


def phase_row(cell, router: str, phase: str, rows: pd.DataFrame, sources: dict, valid: bool, seed: int = 0) -> dict:
    """One line of results/routers.csv: a router's phase in one cell."""
    ok = rows[rows["error"].fillna("") == ""]
    ttft = ok["ttft_s"].astype(float).to_numpy()
    p50, p99 = (np.percentile(ttft, [50, 99]) if len(ttft) else (np.nan, np.nan))
    low, high = percentile_ci(ttft, 50, seed=seed)
    total = sum(v for v in sources.values() if v is not None) or np.nan
    per_replica = rows["serve_replica"].value_counts()
    return {
        "cell": cell.name, "backend": cell.backend, "arm": cell.arm, "chunk": cell.chunk, "tier": cell.tier,
        "router": router, "phase": phase, "valid": valid, "requests": len(rows),
        "ttft_p50_s": p50, "ttft_p50_ci_low_s": low, "ttft_p50_ci_high_s": high, "ttft_p99_s": p99,
        "local_cache_fraction": (sources["local_cache_hit"] or 0) / total,
        "pool_fraction": (sources["external_kv_transfer"] or 0) / total,
        "computed_fraction": (sources["local_compute"] or 0) / total,
        "moved_fraction": float((~rows["seen_before"].astype(bool)).mean()) if len(rows) else np.nan,
        "max_replica_share": float(per_replica.max() / len(rows)) if len(rows) else np.nan,
        "errors": len(rows) - len(ok),
    }


def markdown(table: pd.DataFrame) -> str:
    """results/routers.md: TTFT and where the prompt tokens came from, per cell, router and phase."""
    lines = ["# Routers: where each request went and where its tokens came from", "",
             "| cell | router | phase | gate | requests | TTFT p50 [95% CI] | TTFT p99 | own cache | pool | computed "
             "| on a replica new to the document | busiest replica's share |", "|" + "---|" * 12]
    for row in table.itertuples():
        lines.append(
            f"| {row.backend} / {row.arm} / chunk {row.chunk} / {row.tier} | {row.router} | {row.phase} | "
            f"{'valid' if row.valid else '**INVALID**'} | {row.requests} | {row.ttft_p50_s:.3g} s "
            f"[{row.ttft_p50_ci_low_s:.3g}, {row.ttft_p50_ci_high_s:.3g}] | {row.ttft_p99_s:.3g} s | "
            f"{row.local_cache_fraction:.0%} | {row.pool_fraction:.0%} | {row.computed_fraction:.0%} | "
            f"{row.moved_fraction:.0%} | {row.max_replica_share:.0%} |")
    return "\n".join(lines) + "\n"
