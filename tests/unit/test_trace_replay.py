"""The trace unit's arithmetic and gate (kvpool.studies.trace_replay), on hand-made traces and rows."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from support import REPO

from kvpool import traces
from kvpool.config import resolve_extends, validated
from kvpool.measure.records import TraceRecord, columns
from kvpool.studies import trace_replay


def config(top: dict | None = None, **trace) -> dict:
    found = {**yaml.safe_load((REPO / "config" / "config.yaml").read_text()), **(top or {})}
    found["trace"] = {"arms": ["shared", "isolated", "off"], "block_tokens": 256, **trace}
    resolve_extends(found, REPO)
    validated(found, REPO)
    return found


def request(index: int, ids: tuple[int, ...], at_s: float = 0.0, tail: int = 0) -> traces.ScaledRequest:
    """A request of whole blocks ``ids`` and, with ``tail``, a partial block of that many tokens after them."""
    return traces.ScaledRequest(index, at_s, ids + ((1000 + index,) if tail else ()), len(ids),
                                len(ids) * 256 + tail, 8)


def rows(arm_rows: list[dict]) -> pd.DataFrame:
    """Trace records with every column, the given ones set."""
    base = {column: None for column in columns(TraceRecord)}
    return pd.DataFrame([{**base, "error": "", "output_tokens": 8, "sampled": False, **row} for row in arm_rows])


def test_units_form_each_arm_per_setting_and_the_off_arm_once():
    found = trace_replay.units(config({"backends": ["lmcache-fs", "lmcache-local-disk"]},
                                      routers=["round-robin", "prefix-affinity"]))
    names = [(cell.backend, cell.arm, router) for cell, router in found]
    assert names.count(("lmcache-fs", "off", "round-robin")) == 1
    assert not any(backend == "lmcache-local-disk" and arm == "off" for backend, arm, _ in names)
    assert {(backend, arm) for backend, arm, _ in names} == {
        ("lmcache-fs", "shared"), ("lmcache-fs", "isolated"), ("lmcache-fs", "off"),
        ("lmcache-local-disk", "shared"), ("lmcache-local-disk", "isolated")}
    assert trace_replay.units(config(arms=[])) == []


def test_the_default_run_has_no_trace_unit():
    default = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    validated(default, REPO)
    assert trace_replay.units(default) == [] and trace_replay.problems(default) == []


def test_requests_too_long_for_the_model_are_left_out_and_counted():
    shipped = traces.read_trace(REPO / "resources" / "traces" / "mooncake-conversation.jsonl.gz")
    wide = config(window_s=[0, 1200], groups=0.01)
    narrow = {**wide, "engine": {**wide["engine"], "max_model_len": 4096}}
    sent, left_out = trace_replay.replayed(wide, shipped)
    kept, dropped = trace_replay.replayed(narrow, shipped)
    assert dropped > left_out and len(kept) + dropped == len(sent) + left_out
    assert all(r.prompt_tokens + r.output_tokens <= 4096 for r in kept)
    capped, _ = trace_replay.replayed({**wide, "trace": {**wide["trace"], "max_requests": 5}}, shipped)
    assert capped == sent[:5]


def test_equal_block_ids_are_equal_prompt_tokens_in_the_models_vocabulary():
    allowed = list(range(100, 300))
    first, second = request(0, (7, 8)), request(1, (7, 9), tail=40)
    one, two = trace_replay.prompts([first, second], allowed, 256, seed=3)
    assert one[:256] == two[:256] and one[256:] != two[256:512] and len(two) == 2 * 256 + 40
    assert set(one) | set(two) <= set(allowed)


def test_a_servable_prefix_stops_at_the_last_whole_chunk_before_the_last_token():
    assert trace_replay.servable(512, 1000, 256) == 512
    assert trace_replay.servable(768, 768, 256) == 512  # vLLM computes the last token whatever it holds
    assert trace_replay.servable(0, 900, 256) == 0


def test_bounds_follow_the_fleet_and_the_routers_placement():
    sent = [request(0, (1, 2)), request(1, (1, 2, 3)), request(2, (1, 2, 3, 4))]
    found = trace_replay.with_bounds([{"serve_replica": 0}, {"serve_replica": 1}, {"serve_replica": 1}], sent, 256)
    assert [row["bound_tokens"] for row in found] == [0, 512, 768]
    assert [row["placed_bound_tokens"] for row in found] == [0, 0, 768]


def shared_rows(served: list[int], bound: list[int]) -> pd.DataFrame:
    return rows([{"key": f"trace-{i}", "prompt_tokens": 2000, "bound_tokens": b, "placed_bound_tokens": 0,
                  "local_cache_hit_tokens": 0, "external_hit_tokens": s, "local_compute_tokens": 2000 - s}
                 for i, (s, b) in enumerate(zip(served, bound, strict=True))])


def test_a_shared_pool_that_served_less_than_a_requests_bound_missed_silently():
    good = trace_replay.checks("shared", shared_rows([0, 512, 1024], [0, 512, 1024]), 256, 256, 0, None)
    assert good["no_silent_miss"]["status"] == "passed"
    bad = trace_replay.checks("shared", shared_rows([0, 256, 1024], [0, 512, 1024]), 256, 256, 0, None)
    assert bad["no_silent_miss"]["status"] == "failed"
    assert bad["no_silent_miss"]["value"] == {"requests": 1, "tokens": 256, "evicted_chunks": 0}
    # a pool that evicted cannot tell a miss from an eviction
    evicted = trace_replay.checks("shared", shared_rows([0, 256, 1024], [0, 512, 1024]), 256, 256, 3, None)
    assert evicted["no_silent_miss"]["status"] == "not_verified"


def test_a_pool_servers_evictions_are_zero_before_its_lazy_counter_appears_and_unknown_if_unread():
    read = {"metrics": {"lmcache_mp_l1_eviction_loop_ticks_total": 104.0}, "l1_bytes": 4.0e10}
    # LMCache exports the evicted-chunks counter only from the first eviction on
    assert trace_replay.server_pool({"0": read}) == (0, 40_000_000_000)
    evicted = {"metrics": {"lmcache_mp_l1_evicted_chunks_total": 7.0}, "l1_bytes": 1.0e9}
    assert trace_replay.server_pool({"0": read, "1": evicted}) == (7, 41_000_000_000)
    died = {"metrics": {}, "l1_bytes": None, "error": "lmcache server 1: exited 1"}
    assert trace_replay.server_pool({"0": read, "1": died}) == (None, None)
    assert trace_replay.server_pool(None) == (None, None)


def test_isolated_and_off_arms_serve_nothing_beyond_the_serving_replicas_own_history():
    def frame(served, placed, external):
        return rows([{"key": "trace-0", "prompt_tokens": 2000, "bound_tokens": 1024, "placed_bound_tokens": placed,
                      "local_cache_hit_tokens": served - external, "external_hit_tokens": external,
                      "local_compute_tokens": 2000 - served}])

    # a partial tail block cached by the earlier request may match up to a block beyond the bound
    assert trace_replay.checks("isolated", frame(512 + 255, 512, 0), 256, 256, None, None)["isolation"]["ok"]
    assert not trace_replay.checks("isolated", frame(1024, 512, 512), 256, 256, None, None)["isolation"]["ok"]
    off = trace_replay.checks("off", frame(512, 512, 256), 256, 256, None, None)
    assert off["isolation"]["ok"] and not off["no_pool"]["ok"]


def test_errors_unattributed_tokens_and_no_sample_are_named():
    frame = shared_rows([0, 512], [0, 512])
    frame.loc[0, "error"] = "replica 1: the request failed"
    frame.loc[1, "local_compute_tokens"] = np.nan
    found = trace_replay.checks("shared", frame, 256, 256, 0, None)
    assert found["zero_errors"]["value"] == 1 and found["hit_attribution"]["value"] == 1
    assert found["output_matches_recompute"]["status"] == "not_applicable"
    assert found["cold_reads"]["status"] == "not_applicable"


def test_the_answer_sample_is_seeded_and_takes_only_reused_requests_that_ran_to_the_cap():
    frame = shared_rows([0, 256, 512, 768, 1024], [0] * 5)
    frame.loc[4, "output_tokens"] = 3  # the trace's own output was shorter than the cap
    picked = trace_replay.sample(frame, 2, 8, seed=1)
    assert picked == trace_replay.sample(frame, 2, 8, seed=1) and len(picked) == 2
    assert picked <= {"trace-1", "trace-2", "trace-3"}
    assert trace_replay.sample(frame, 10, 8, seed=1) == {"trace-1", "trace-2", "trace-3"}


def test_a_units_row_counts_recovery_against_both_bounds():
    from kvpool.cells import Cell

    frame = rows([{"key": "trace-0", "prompt_tokens": 1000, "bound_tokens": 0, "placed_bound_tokens": 0,
                   "local_cache_hit_tokens": 0, "external_hit_tokens": 0, "local_compute_tokens": 1000, "ttft_s": 1.0},
                  {"key": "trace-1", "prompt_tokens": 1000, "bound_tokens": 512, "placed_bound_tokens": 256,
                   "local_cache_hit_tokens": 256, "external_hit_tokens": 256, "local_compute_tokens": 488,
                   "ttft_s": 0.5},
                  {"key": "trace-2", "prompt_tokens": 1000, "bound_tokens": 512, "placed_bound_tokens": 512,
                   "local_cache_hit_tokens": 256, "external_hit_tokens": 0, "local_compute_tokens": 744,
                   "ttft_s": 6.0}])
    meta = {"valid": True, "checks": {}, "scaling": {"block_tokens": 256, "window_s": [0, 60], "groups": 1.0,
                                                      "speedup": 1.0}}
    row = trace_replay.unit_row(Cell("lmcache-fs", "shared", 256, "disk"), "round-robin", frame, meta, slo_s=5.0)
    assert row["bound_tokens"] == 1024 and row["recovered_of_bound"] == pytest.approx(768 / 1024)
    assert row["recovered_of_placed_bound"] == pytest.approx((256 + 256) / 768)
    assert row["slo_attainment"] == pytest.approx(2 / 3) and row["slo_ci_low"] < 2 / 3 < row["slo_ci_high"]
    assert row["own_cache_tokens"] == 512 and row["pool_tokens"] == 256 and row["ttft_n"] == 3


def test_the_gate_and_the_page_read_the_trace_table(tmp_path):
    from kvpool.report import trace
    from kvpool.report.gate import judge

    table = pd.DataFrame([{"cell": "backend~lmcache-fs/arm~shared/chunk~256/tier~disk", "backend": "lmcache-fs",
                           "arm": "shared", "chunk": 256, "tier": "disk", "router": "round-robin", "valid": False,
                           "requests": 3, "left_out_too_long": 0, "bound_tokens": 1024, "recovered_of_bound": 0.5,
                           "recovered_of_placed_bound": 1.0, "own_cache_tokens": 256, "pool_tokens": 256,
                           "silent_misses": 1, "ttft_p50_s": 0.1, "ttft_p50_ci_low_s": 0.05,
                           "ttft_p50_ci_high_s": 0.2, "ttft_n": 3, "ttft_p99_s": 0.3, "ttft_p99_basis": "max of 3",
                           "slo_attainment": 1.0, "slo_ci_low": 0.44, "slo_ci_high": 1.0, "slo_s": 5.0,
                           "energy_per_request_j": np.nan, "pool_bytes_end": 1e6, "window_s": "0-60",
                           "groups": 1.0, "block_tokens": 256, "speedup": 1.0}])
    csv = tmp_path / "trace.csv"
    table.to_csv(csv, index=False)
    lines, counted, *_ = judge(pd.DataFrame(columns=["cell", "valid", "reasons"]), None, trace_csv=str(csv))
    assert lines == ["  backend~lmcache-fs/arm~shared/chunk~256/tier~disk trace~round-robin: its run.json names "
                     "the failed checks"] and counted == ["1 trace units"]
    shown = trace.section(str(csv))
    assert shown["markdown"].startswith("| cell | router | gate |") and "**INVALID**" in shown["markdown"]
    assert "| 1 |" in shown["markdown"] and "50.0%" in shown["markdown"]
    assert [Path(f["png"]).name for f in shown["figures"]] == ["recovered.png", "ttft.png"]


def test_the_tiers_room_counts_a_trace_units_pool_beside_the_largest_cell(tmp_path, free_disk):
    import re

    from kvpool.config import problems
    from kvpool.engine.model import engine_pool_bytes_per_token

    free_disk(0)
    without = config({"keep_pools": False}, arms=[])
    with_trace = config({"keep_pools": False}, window_s=[0, 1200], groups=0.01)

    def needed(found: list[str]) -> tuple[float, str]:
        (line,) = [p for p in found if "GB available but needs" in p]
        return float(re.search(r"needs ([\d.]+) GB", line).group(1)), line

    before, _ = needed(problems(without, tmp_path))
    after, line = needed(problems(with_trace, tmp_path))
    bound = trace_replay.pool_bound_tokens(with_trace) * engine_pool_bytes_per_token(with_trace)
    assert "and a trace unit's" in line and after - before == pytest.approx(bound / 1e9, abs=0.01)
