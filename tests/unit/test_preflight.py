"""The populate preflight against scripted replicas: who finds the probe, and what each answers."""

import asyncio
from types import SimpleNamespace

import pytest

from kvpool.engine.client import RequestResult
from kvpool.measure import timed
from kvpool.studies import study_a_phases

PROBE, EXTENSION = [1, 2, 3], [1, 2, 3, 4]


def run_preflight(monkeypatch, expect_shared: bool, hits: int, pool_output: str, local_output: str, error: str = ""):
    """Replica 1 loads ``hits`` probe tokens and answers ``pool_output``; replica 0 answers ``local_output``."""
    counters = {"r1": 0}
    sent = []

    async def complete(session, url, prompt, output_tokens, timeout_s, cache_salt=None, token_ids=False):
        sent.append((url, prompt))
        if url == "r1":
            counters["r1"] += hits
            return RequestResult(output_text=pool_output, error=error)
        return RequestResult(output_text=local_output if prompt == EXTENSION else "stored")

    async def scrape(session, url):
        return {"external_kv_transfer": counters.get(url, 0), "local_compute": 0}

    monkeypatch.setattr(study_a_phases, "complete", complete)  # the probe's own requests
    monkeypatch.setattr(timed, "complete", complete)  # the measured one, and the counters around it
    monkeypatch.setattr(timed.metrics, "scrape", scrape)
    replicas = [SimpleNamespace(url=f"r{i}", index=i, alive=lambda: True) for i in (0, 1)]
    result = asyncio.run(study_a_phases._preflight(None, replicas, PROBE, EXTENSION, 8, 60.0, expect_shared))
    # replica 0 stores the probe, replica 1 asks for the extension, then replica 0 answers it from its cache
    assert sent == [("r0", PROBE), ("r1", EXTENSION), ("r0", EXTENSION)]
    return result


def test_a_shared_pool_that_returns_the_stored_kv_passes(monkeypatch):
    result = run_preflight(monkeypatch, expect_shared=True, hits=512, pool_output=" w1 w2", local_output=" w1 w2")
    assert result["ok"] and result["outputs_match"] and result["hit_tokens"] == 512


def test_a_shared_pool_that_returns_different_kv_fails_and_says_so(monkeypatch):
    result = run_preflight(monkeypatch, expect_shared=True, hits=512, pool_output=" w9 w8", local_output=" w1 w2")
    assert not result["ok"] and not result["outputs_match"]
    message = study_a_phases.preflight_failure("cell-x", result)
    assert "loaded 512 tokens" in message and "' w9 w8'" in message and "' w1 w2'" in message
    assert "different KV" in message


def test_a_shared_pool_that_misses_fails_as_not_shared(monkeypatch):
    result = run_preflight(monkeypatch, expect_shared=True, hits=0, pool_output=" w1 w2", local_output=" w1 w2")
    assert not result["ok"]
    assert "expected a hit: the pool is not shared" in study_a_phases.preflight_failure("cell-x", result)


@pytest.mark.parametrize("pool_output", [" w1 w2", " w9 w8"])
def test_an_isolated_arm_only_needs_to_miss(monkeypatch, pool_output):
    # replica 1 computes cold there, so its answer says nothing about a pool
    result = run_preflight(monkeypatch, expect_shared=False, hits=0, pool_output=pool_output, local_output=" w1 w2")
    assert result["ok"]
    leaked = run_preflight(monkeypatch, expect_shared=False, hits=512, pool_output=pool_output, local_output=" w1 w2")
    assert not leaked["ok"]
    assert "expected none: the arm is not isolated" in study_a_phases.preflight_failure("cell-x", leaked)


def test_a_failed_probe_request_is_named(monkeypatch):
    result = run_preflight(monkeypatch, expect_shared=True, hits=0, pool_output="", local_output="", error="HTTP 500")
    assert not result["ok"]
    message = study_a_phases.preflight_failure("cell-x", result)
    assert "a probe request failed: replica 1: the request failed: HTTP 500" in message
