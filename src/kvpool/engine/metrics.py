"""A replica's Prometheus counters that prove where a prompt's tokens came from."""

from __future__ import annotations

import re

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"


# Where a request's time went, from the histograms vLLM keeps per request: with one request at a time on a
# replica, the change of a histogram's sum around the request is that request's own time, and the change of
# its count says it was one request. (LMCache's own histograms stay in the engine process, out of the
# replica's /metrics: its retrieve is read from its log, :func:`lmcache_retrievals`.)
TIMINGS = {
    "queue_s": "vllm:request_queue_time_seconds",
    "prefill_s": "vllm:request_prefill_time_seconds",
    "decode_s": "vllm:request_decode_time_seconds",
    "server_ttft_s": "vllm:time_to_first_token_seconds",
}
# LMCache's line for each retrieve (lmcache.v1.cache_engine), naming vLLM's request as
# <the completion's id>-<prompt index>-<suffix>: "[req_id=cmpl-b682...-0-933ac0ec] Retrieved 2048 out of
# 2048 required tokens (from 2048 total tokens). size: 0.0078 gb, cost 26.0428 ms, throughput: 0.3000 GB/s"
RETRIEVED = re.compile(r"\[req_id=(?P<request>\S+?)-\d+-[0-9a-f]+\] Retrieved (?P<tokens>\d+) out of \d+ required "
                       r"tokens.*?cost (?P<ms>[\d.]+) ms")


def token_counters(metrics_text: str) -> dict[str, float]:
    """External-hit and per-source prompt-token counters, summed over engines, and each of ``TIMINGS``'
    histograms as ``<part>_sum`` and ``<part>_count`` where the replica exports it."""
    counters = {"external_hits": 0.0, "external_kv_transfer": 0.0, "local_compute": 0.0, "local_cache_hit": 0.0}
    timed = {name: part for part, name in TIMINGS.items()}
    for family in text_string_to_metric_families(metrics_text):
        part = timed.get(family.name) if family.type == "histogram" else None
        for sample in family.samples:
            if sample.name == EXTERNAL_HITS:
                counters["external_hits"] += sample.value
            elif sample.name == TOKENS_BY_SOURCE and sample.labels.get("source") in counters:
                counters[sample.labels["source"]] += sample.value
            elif part and sample.name in (f"{family.name}_sum", f"{family.name}_count"):
                key = f"{part}{sample.name.removeprefix(family.name)}"
                counters[key] = counters.get(key, 0.0) + sample.value
    return counters


async def scrape(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    async with session.get(f"{base_url}/metrics", timeout=aiohttp.ClientTimeout(total=30)) as response:
        response.raise_for_status()
        return token_counters(await response.text())


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int | float]:
    """What changed between two scrapes: token counts and histogram counts as integers, seconds as they are."""
    change = {key: after[key] - before.get(key, 0.0) for key in after}
    return {key: value if key.endswith("_sum") else int(round(value)) for key, value in change.items()}


def lmcache_retrievals(log_text: str) -> dict[str, dict]:
    """Each retrieve an in-process LMCache logged, by the completion's id: tokens retrieved and seconds (the
    retrieves of one request summed)."""
    found: dict[str, dict] = {}
    for match in RETRIEVED.finditer(log_text):
        entry = found.setdefault(match["request"], {"retrieved_tokens": 0, "retrieve_s": 0.0})
        entry["retrieved_tokens"] += int(match["tokens"])
        entry["retrieve_s"] += float(match["ms"]) / 1e3
    return found


def request_timings(change: dict) -> dict[str, float | None]:
    """A request's own times from the change around it (:func:`delta`): each part of ``TIMINGS`` whose
    histogram counted exactly one request meanwhile; None where it counted none or several (another
    request overlapped) or the replica does not export it."""
    return {part: change[f"{part}_sum"] if change.get(f"{part}_count") == 1 else None for part in TIMINGS}
