"""A replica's Prometheus counters that prove where a prompt's tokens came from."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"


def token_counters(metrics_text: str) -> dict[str, float]:
    """External-hit and per-source prompt-token counters, summed over engines."""
    counters = {"external_hits": 0.0, "external_kv_transfer": 0.0, "local_compute": 0.0, "local_cache_hit": 0.0}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == EXTERNAL_HITS:
                counters["external_hits"] += sample.value
            elif sample.name == TOKENS_BY_SOURCE and sample.labels.get("source") in counters:
                counters[sample.labels["source"]] += sample.value
    return counters


async def scrape(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    async with session.get(f"{base_url}/metrics", timeout=aiohttp.ClientTimeout(total=30)) as response:
        response.raise_for_status()
        return token_counters(await response.text())


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {key: int(round(after[key] - before[key])) for key in after}
