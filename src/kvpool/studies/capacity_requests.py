"""A capacity unit's requests (kvpool.studies.capacity): which documents its follow-ups ask for, drawn
with a seeded Zipf popularity over a seeded ranking, and the driver that sends populate and the follow-ups
one at a time (``Asking``), the pool's evictions read, settled, and each follow-up's own GPU energy
(``request_energy``) around each.
"""

from __future__ import annotations

import contextlib

import numpy as np
from scipy import stats

from kvpool.engine.client import new_session
from kvpool.engine.cross_router import followup_route, populate_route
from kvpool.measure.telemetry import Nvml
from kvpool.measure.timed import measured_request, request_row, reset_prefix_cache


def popularity_ranks(documents: int, exponent: float, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` popularity ranks (1 = most popular) of ``documents``: Zipf with ``exponent`` (scipy's
    finite ``zipfian``), uniform at 0."""
    if exponent == 0:
        return rng.integers(1, documents + 1, size=count)
    return stats.zipfian(exponent, documents).rvs(size=count, random_state=rng)


def fitted_exponent(ranks: np.ndarray, documents: int) -> float:
    """The Zipf exponent that best explains ``ranks`` (scipy's maximum-likelihood fit, ``n`` held)."""
    fit = stats.fit(stats.zipfian, ranks, bounds={"a": (0.0, 5.0), "n": (documents, documents)})
    return float(fit.params.a)


def draws(documents: int, exponent: float, count: int, seed: int) -> list[int]:
    """The documents of ``count`` follow-ups: ranks drawn by popularity, mapped onto documents by a seeded
    ranking, so popularity is independent of the order populate stored them in (LRU evicts by it)."""
    rng = np.random.default_rng(seed)
    ranking = rng.permutation(documents)
    return [int(ranking[rank - 1]) for rank in popularity_ranks(documents, exponent, count, rng)]


@contextlib.contextmanager
def request_energy(gpus: list[int]):
    """A reader of the GPUs' summed energy counter (J, NVML's), or of None without one (CPU replicas): a
    follow-up's own energy, apart from the window's waits between requests (the evictions read settled)."""
    nvml = Nvml(gpus) if gpus else None
    try:
        yield (lambda: sum(nvml.energy_j())) if nvml is not None and nvml.available else (lambda: None)
    finally:
        if nvml is not None and nvml.available:
            nvml.close()


class Asking:
    """A capacity unit's requests on its fleet, one at a time: populate, and drawn follow-ups with the
    server's evictions read, settled, around each."""

    def __init__(self, replicas, workload: list[dict], cfg: dict, pool, energy=lambda: None):
        self.by_index, self.by_doc = {r.index: r for r in replicas}, {item["doc_id"]: item for item in workload}
        self.prefill = populate_route(list(self.by_doc), len(replicas))
        self.route = followup_route(self.prefill, len(replicas))
        self.output_tokens, self.timeout_s = cfg["workload"]["output_tokens"], cfg["engine"]["request_timeout_s"]
        self.pool, self.energy, self.populated = pool, energy, []

    async def populate(self) -> dict:
        """Every document once on its replica, each with the server's evictions as its store began; the
        pool's state once its stores have landed."""
        async with new_session() as session:
            for doc_id, item in self.by_doc.items():
                replica = self.by_index[self.prefill[doc_id]]
                before = self.pool.evicted()
                result, counts = await measured_request(session, replica, item["document"], self.output_tokens,
                                                        self.timeout_s)
                self.pool.stored(doc_id)
                self.populated.append({**request_row(doc_id, replica.index, replica.index, result, counts),
                                       "part": "populate", "evicted_before": before})
        self.pool.settled()
        return self.pool.state()

    async def followups(self, sequence: list[int], part: str, first: int, reset_own_cache: bool) -> list[dict]:
        rows = []
        async with new_session() as session:
            for number, doc_id in enumerate(sequence, start=first):
                serve = self.by_index[self.route[doc_id]]
                reset = await reset_prefix_cache(session, serve) if reset_own_cache else ""
                before = self.pool.settled()
                held, joules = self.pool.holds(doc_id), self.energy()
                result, counts = await measured_request(session, serve, self.by_doc[doc_id]["followup"],
                                                        self.output_tokens, self.timeout_s)
                used = None if joules is None else self.energy() - joules
                if reset and not result.error:
                    result.error = f"the prefix cache reset before this follow-up failed: {reset}"
                rows.append({**request_row(doc_id, self.prefill[doc_id], serve.index, result, counts), "part": part,
                             "sequence": number, "evicted_before": before, "evicted_after": self.pool.settled(),
                             "held_before": held, "gpu_energy_j": used})
        return rows
