"""Load levels: seeded arrival schedules, the in-flight limit, hit attribution and the pool restore."""

import asyncio
import json
import time

import aiohttp
import numpy as np
import pandas as pd
import pytest
from aiohttp import web
from support import completions_server, passing_gate_inputs

from kvpool.measure import kvbytes
from kvpool.measure.reuse_checks import files_restored, memory_restored, repopulated, restore_pool
from kvpool.report import gate
from kvpool.studies.load import (
    Level,
    arrival_offsets,
    attribution,
    level_checks,
    levels,
    send_level,
)


def test_levels_are_named_and_parsed_back():
    config = {"load": {"concurrency": [1, 4, 16], "rates": [0.5, 2]}}
    assert [level.name for level in levels(config)] == ["c4", "c16", "r0.5", "r2"]  # c1 is the reuse phase
    assert Level.from_name("c16") == Level("concurrency", 16) and Level.from_name("r0.5") == Level("rate", 0.5)
    with pytest.raises(ValueError, match="c<concurrency>, r<rate> or peer"):
        Level.from_name("x3")


def test_arrivals_are_seeded_start_at_zero_and_keep_the_mean_rate():
    offsets = arrival_offsets(rate=4.0, count=4000, burstiness=1.0, seed=7)
    assert len(offsets) == 4000 and offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0)
    assert np.array_equal(offsets, arrival_offsets(4.0, 4000, 1.0, 7))
    assert not np.array_equal(offsets, arrival_offsets(4.0, 4000, 1.0, 8))
    gaps = np.diff(offsets)
    assert abs(gaps.mean() - 0.25) < 0.02  # 1 / rate
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.1  # Poisson: exponential gaps, coefficient of variation 1


def test_burstiness_below_one_makes_gaps_burstier_at_the_same_rate():
    bursty = np.diff(arrival_offsets(rate=4.0, count=4000, burstiness=0.25, seed=7))
    assert abs(bursty.mean() - 0.25) < 0.04
    assert bursty.std() / bursty.mean() > 1.7  # gamma shape k: coefficient of variation 1 / sqrt(k) = 2


class StandIn:
    """A completions server that answers after ``delay_s`` and counts the requests in flight."""

    def __init__(self, delay_s: float):
        self.delay_s, self.in_flight, self.most = delay_s, 0, 0
        self.arrivals: list[float] = []

    async def completions(self, request):
        body = await request.json()
        self.arrivals.append(time.monotonic())
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        usage = {"prompt_tokens": len(body["prompt"]), "prompt_tokens_details": {"cached_tokens": 3}}
        await response.write((f"data: {json.dumps({'choices': [{'text': ' w'}]})}\n\n"
                              f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n").encode())
        await response.write_eof()
        return response


async def run_level(level: Level, count: int, delay_s: float, max_in_flight: int = 32):
    stand_in = StandIn(delay_s)
    async with completions_server(stand_in.completions) as url, aiohttp.ClientSession() as session:
        started = time.monotonic()
        sent = await send_level(session, level, [(i, url, [1, 2, 3, 4]) for i in range(count)], 1, 30.0,
                                max_in_flight, 1.0, 0)
    return sent, stand_in, started


def test_a_closed_loop_level_keeps_exactly_n_in_flight():
    sent, stand_in, _ = asyncio.run(run_level(Level("concurrency", 3), count=9, delay_s=0.2))
    assert stand_in.most == 3
    assert [doc_id for doc_id, _, _ in sent] == list(range(9))
    assert all(result.ok and result.cached_tokens == 3 for _, _, result in sent)


def test_an_open_loop_level_sends_on_schedule_capped_by_max_in_flight():
    level = Level("rate", 20.0)
    sent, stand_in, started = asyncio.run(run_level(level, count=12, delay_s=0.05))
    due = arrival_offsets(20.0, 12, 1.0, 0)
    assert [offset for _, offset, _ in sent] == pytest.approx(list(due))
    # each request reached the server no earlier than it was due (and not long after, unloaded)
    late = np.array(stand_in.arrivals) - started - np.sort(due)
    assert (late > -0.005).all() and np.median(late) < 0.1
    capped, stand_in, _ = asyncio.run(run_level(Level("rate", 1000.0), count=12, delay_s=0.2, max_in_flight=2))
    assert stand_in.most == 2 and all(result.ok for _, _, result in capped)


def records(cached, prefill=(0, 1), serve=(1, 0), errors=("", "")):
    return pd.DataFrame({"cached_tokens": cached, "prefill_replica": prefill, "serve_replica": serve,
                         "error": errors})


def test_hits_are_attributed_per_request_and_checked_against_the_window():
    agree = attribution(records([2048, 2048]), window_external=4096)
    assert agree["agree"] and agree["per_request_cached_tokens"] == 4096
    assert not attribution(records([2048, 2048]), window_external=2048)["agree"]
    assert not attribution(records([2048, 2048]), window_external=None)["agree"]  # /metrics unreadable


def test_a_levels_gate_fails_on_missing_hits_disagreement_or_an_isolated_hit():
    unchanged = files_restored({"files": 9, "changed": 0, "missing": 0, "example": ""})
    drop = {"resident_fraction": 0.0, "memory_backed": False}

    def gate(arm, cached, window):
        frame = records(cached)
        return level_checks(arm, frame, attribution(frame, window), drop, unchanged, 2048, 0.9, 0.05)

    assert gate("shared", [2048, 2048], 4096)["valid"]
    assert not gate("shared", [2048, 256], 2304)["checks"]["pool_hits"]["ok"]
    assert not gate("shared", [2048, 2048], 2048)["checks"]["hit_attribution"]["ok"]
    assert gate("isolated", [0, 0], 0)["valid"]
    assert not gate("isolated", [2048, 0], 2048)["checks"]["isolation"]["ok"]
    changed = level_checks("shared", records([2048, 2048]), attribution(records([2048, 2048]), 4096), drop,
                           files_restored({**unchanged["value"], "changed": 1}), 2048, 0.9, 0.05)
    assert not changed["checks"]["pool_restored"]["ok"]
    # a page-cache-resident pool fails on a drive, as the cell's gate; a RAM tier has nothing to drop
    warm = {"resident_fraction": 1.0, "memory_backed": False}
    shared = records([2048, 2048])
    assert not level_checks("shared", shared, attribution(shared, 4096), warm, unchanged, 2048, 0.9,
                            0.05)["checks"]["cold_reads"]["ok"]
    assert level_checks("shared", shared, attribution(shared, 4096), {**warm, "memory_backed": True}, unchanged,
                        2048, 0.9, 0.05)["valid"]


def test_a_level_whose_replica_died_judges_the_pool_on_the_requests_that_were_answered():
    """A killed replica's requests fail (the errors check's to judge); the answered ones loaded their
    document, and pool_hits says so rather than 0.0."""
    unchanged = files_restored({"files": 9, "changed": 0, "missing": 0, "example": ""})
    drop = {"resident_fraction": 0.0, "memory_backed": False}
    frame = records([2048, None, 2048], prefill=(0, 1, 0), serve=(1, 0, 1), errors=("", "replica 0 died", ""))
    gate = level_checks("shared", frame, attribution(frame, 4096), drop, unchanged, 2048, 0.9, 0.05)
    hits = gate["checks"]["pool_hits"]
    assert hits["ok"] and hits["value"] == 1.0 and (hits["answered"], hits["requests"]) == (2, 3)
    assert not gate["checks"]["zero_errors"]["ok"] and not gate["valid"]
    none = records([None, None], errors=("died", "died"))
    assert not level_checks("shared", none, attribution(none, 0), drop, unchanged, 2048, 0.9, 0.05)["checks"][
        "pool_hits"]["ok"]


def test_a_memory_pool_populated_again_must_match_the_cells_populate():
    """A memory pool's level populates fresh servers; only the same placement, no errors, a passed
    preflight and the cell's pool bytes count as restored."""
    cell = pd.DataFrame({"doc_id": [0, 1], "prefill_replica": [0, 1], "error": [None, None]})
    meta = {"preflight": {"ok": True}, "pool": {"bytes": 4096}}
    assert memory_restored(repopulated(cell, meta, cell, meta))["ok"]
    swapped = cell.assign(prefill_replica=[1, 0])
    assert not memory_restored(repopulated(cell, meta, swapped, meta))["value"]["same_placement"]
    failed = cell.assign(error=[None, "HTTP 500"])
    assert memory_restored(repopulated(cell, meta, failed, meta))["value"]["errors"] == 1
    assert not memory_restored(repopulated(cell, meta, failed, meta))["ok"]
    short = {**meta, "pool": {"bytes": 2048}}  # a server that kept less (L1 evicted, a store lost)
    assert not memory_restored(repopulated(cell, meta, cell, short))["ok"]
    assert not memory_restored(repopulated(cell, meta, cell, {**meta, "preflight": {"ok": False}}))["ok"]


def test_the_pool_is_restored_to_what_populate_left(tmp_path):
    shared = tmp_path / "shared"
    (shared / "a").mkdir(parents=True)
    for name in ("a/doc0.pt", "a/doc1.pt"):
        (shared / name).write_bytes(name.encode() * 100)
    populate = kvbytes.pool_digests([shared])
    (shared / "a" / "followup.pt").write_bytes(b"stored by a level")
    (shared / "b").mkdir()
    (shared / "b" / "doc0-again.pt").write_bytes(b"stored by an isolated replica")
    assert restore_pool([shared, shared], populate) == {"removed_files": 2, "kept_files": 2}
    after = kvbytes.pool_digests([shared], populate)
    assert kvbytes.unchanged(populate, after)["changed"] == 0 and len(after) == 2
    assert set(after["stored_in"]) == {"populate"}


def test_a_load_row_reports_what_the_fleet_delivered_in_the_levels_window():
    from kvpool.cells import Cell
    from kvpool.report.load import load_markdown
    from kvpool.studies.load_table import load_row

    records = pd.DataFrame({"ttft_s": [0.2, 0.4, 6.0, np.nan], "e2e_s": [0.3, 0.5, 6.2, np.nan],
                            "external_hit_tokens": [2048, 2048, 2048, 0], "error": ["", "", "", "replica 1 died"]})
    config = {"workload": {"output_tokens": 8, "doc_tokens": 2048}, "slo_s": 5.0}
    drive = {"available": True, "read_gb_per_s": 0.5, "aqu_sz": {"p95": 3.0}}
    row = load_row(Cell("lmcache-fs", "shared", 256, "disk"), "c4", records, {"wall_s": 2.0}, drive,
                   {"mean_power_w": None, "energy_per_request_j": None}, True, config, per_token=65536)
    assert row["level_kind"] == "concurrency" and row["level_value"] == 4 and row["requests"] == 4
    assert row["errors"] == 1 and row["ttft_p50_s"] == pytest.approx(0.4)
    assert row["achieved_rps"] == 1.5 and row["output_tokens_per_s"] == 12.0  # 3 answered in 2 s
    assert row["goodput_rps"] == 1.0  # two of them within slo_s
    assert row["hit_fraction"] == 0.75 and row["queue_depth_p95"] == 3.0 and np.isnan(row["mean_power_w"])
    assert row["ttft_p50_ci_low_s"] <= row["ttft_p50_s"] <= row["ttft_p50_ci_high_s"]
    # the answered follow-ups' hit tokens (3 x 2,048) x 64 KiB of KV each, over the 2 s window
    assert row["loaded_gb_per_s"] == pytest.approx(3 * 2048 * 65536 / 2.0 / 1e9)
    unknown = load_row(Cell("lmcache-fs", "shared", 256, "disk"), "c4", records, {"wall_s": 2.0}, drive,
                       {"mean_power_w": None, "energy_per_request_j": None}, True, config)
    assert np.isnan(unknown["loaded_gb_per_s"])  # a model whose KV size cannot be read: no rate, not zero
    table = load_markdown(pd.DataFrame([row]))
    line = table.splitlines()[2]
    assert [cell.strip() for cell in line.strip("|").split("|")][:4] == [
        "lmcache-fs / shared / chunk 256 / disk", "c4", "valid", "0.4 s [0.2, 6] (n=3)"]
    # three answers make no p95 or p99: the table names the largest
    assert row["ttft_p99_basis"] == "max of 3" and "max of 3: 6 s" in line
    assert "1.5 req/s" in line and "1 of 4" in line and "0.201 GB/s" in line


def test_the_load_figures_draw_from_the_load_table(tmp_path):
    from kvpool.report import figures

    rows = []
    for arm, base in (("shared", 0.2), ("isolated", 1.0)):
        for kind, value in (("concurrency", 1), ("concurrency", 2), ("concurrency", 4), ("rate", 0.5)):
            name = f"c{value}" if kind == "concurrency" else f"r{value:g}"
            rows.append({"backend": "lmcache-fs", "chunk": 256, "tier": "disk", "arm": arm, "level": name,
                         "level_kind": kind, "level_value": float(value), "valid": True,
                         "ttft_p50_s": base * value, "ttft_p50_ci_low_s": base * value * 0.9,
                         "ttft_p50_ci_high_s": base * value * 1.1, "ttft_p99_s": base * value * 1.5,
                         "achieved_rps": value / base, "goodput_rps": 0.5, "drive_read_gb_per_s": 0.1 * value,
                         "loaded_gb_per_s": 0.12 * value})
    load = pd.DataFrame(rows)
    ceilings = pd.DataFrame([{"backend": "lmcache-fs", "chunk": 256, "tier": "disk", "ceiling_read_gb_per_s": 0.9}])
    # a memory pool: no drive read and no ceiling, only the KV the replicas loaded
    memory = load.assign(tier="ram", drive_read_gb_per_s=np.nan)
    no_ceiling = pd.DataFrame(columns=["backend", "chunk", "tier", "ceiling_read_gb_per_s"])
    reload = figures.load_reload_rate(load, ceilings)
    assert set(reload.data["measure"]) == {"drive read", "KV loaded"}
    memory_reload = figures.load_reload_rate(memory, no_ceiling)
    assert set(memory_reload.data["measure"]) == {"KV loaded"}
    for stem, plot in (("ttft", figures.load_ttft(load)), ("throughput", figures.load_throughput(load)),
                       ("goodput", figures.load_goodput(load)), ("reload", reload),
                       ("memory-reload", memory_reload)):
        paths = figures.save(plot, tmp_path, stem)
        assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", stem


def test_the_gate_fails_on_a_load_level_beyond_c1_and_counts_the_levels_it_rests_on(tmp_path):
    """c1 is the cell's own reuse phase, judged by its validity gate: the load table's c1 row is not judged
    again. Every other level is, and the gate's line says how many it rests on and how many of them have
    answers that were not verified (batch composition)."""

    cell = "backend~lmcache-fs/arm~shared/chunk~256/tier~disk"
    validity, kv_bytes = passing_gate_inputs(tmp_path, cell)
    levels = pd.DataFrame({"cell": cell, "level": ["c1", "c2", "c4"], "valid": [False, True, False],
                           "outputs_checked": ["passed", "not_verified", "not_verified"]})
    load_csv = tmp_path / "load.csv"
    levels.to_csv(load_csv, index=False)
    with pytest.raises(SystemExit, match="load~c4: its level.json") as failed:
        gate.gate(validity, kv_bytes, str(tmp_path / "gate.ok"), load_csv=str(load_csv))
    assert "load~c1" not in str(failed.value) and not (tmp_path / "gate.ok").exists()
    levels.assign(valid=[False, True, True]).to_csv(load_csv, index=False)
    gate.gate(validity, kv_bytes, str(tmp_path / "gate.ok"), load_csv=str(load_csv))
    assert "; 2 load levels (2 with answers not verified) valid" in (tmp_path / "gate.ok").read_text()


def test_a_levels_window_splits_its_requests_time_by_the_replicas_own_histograms():
    """Many requests in flight: no request's own split, but the window's means per part, summed over
    the serving replicas' histogram changes."""
    from kvpool.engine.metrics import token_counters
    from kvpool.measure.timed import times_window

    def scrape(queue_sum, queue_count, prefill_sum, prefill_count):
        text = "\n".join([
            "# TYPE vllm:request_queue_time_seconds histogram",
            f'vllm:request_queue_time_seconds_bucket{{le="+Inf"}} {queue_count}',
            f"vllm:request_queue_time_seconds_sum {queue_sum}",
            f"vllm:request_queue_time_seconds_count {queue_count}",
            "# TYPE vllm:request_prefill_time_seconds histogram",
            f'vllm:request_prefill_time_seconds_bucket{{le="+Inf"}} {prefill_count}',
            f"vllm:request_prefill_time_seconds_sum {prefill_sum}",
            f"vllm:request_prefill_time_seconds_count {prefill_count}", ""])
        return token_counters(text)

    before = {0: scrape(1.0, 10, 2.0, 10), 1: scrape(0.0, 0, 0.0, 0)}
    after = {0: scrape(4.0, 40, 5.0, 40), 1: scrape(3.0, 20, 1.5, 20)}
    split = times_window(before, after)
    assert split["queue_s"] == {"requests": 50, "mean_s": pytest.approx(6.0 / 50)}
    assert split["prefill_s"] == {"requests": 50, "mean_s": pytest.approx(4.5 / 50)}
    assert "decode_s" not in split  # not exported here: no entry rather than a zero
    idle = times_window(before, before)
    assert idle["queue_s"] == {"requests": 0, "mean_s": None}


def test_the_load_table_gains_the_time_split_only_where_a_level_recorded_it():
    from kvpool.report.load import load_for_reading
    from kvpool.studies.load_table import time_split

    reuse = pd.DataFrame({"queue_s": [0.01, 0.03, np.nan], "prefill_s": [0.05, 0.07, 0.06]})
    split = time_split(reuse, {})  # the reuse phase: its requests' own times
    assert split["queue_mean_s"] == pytest.approx(0.02) and split["prefill_mean_s"] == pytest.approx(0.06)
    assert np.isnan(split["decode_mean_s"]) and np.isnan(split["server_ttft_mean_s"])
    level = time_split(pd.DataFrame({"ttft_s": [0.5]}),
                       {"window_times": {"queue_s": {"requests": 64, "mean_s": 0.25},
                                         "prefill_s": {"requests": 0, "mean_s": None}}})
    assert level["queue_mean_s"] == 0.25 and np.isnan(level["prefill_mean_s"])
    row = {"backend": "lmcache-mp", "arm": "shared", "chunk": 256, "tier": "ram", "level": "c32", "valid": True,
           "ttft_p50_s": 0.5, "ttft_p50_ci_low_s": 0.4, "ttft_p50_ci_high_s": 0.6, "ttft_n": 64, "ttft_p99_s": 1.0,
           "e2e_p50_s": 0.8, "achieved_rps": 30.0, "goodput_rps": 30.0, "output_tokens_per_s": 240.0,
           "hit_fraction": 1.0, "errors": 0, "requests": 64, "drive_read_gb_per_s": np.nan,
           "queue_depth_p95": np.nan, "mean_power_w": 350.0, "energy_per_request_j": 12.0}
    assert "queue / prefill mean" not in load_for_reading(pd.DataFrame([row])).columns
    shown = load_for_reading(pd.DataFrame([{**row, **level}]))
    assert shown.loc[0, "queue / prefill mean"] == "0.25 s / n/a"


def test_the_client_drops_idle_connections_before_vllms_server_does():
    """vLLM's API server closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s); a client keeping it
    longer can send on a closing socket ("Server disconnected", seen on a /reset_prefix_cache after 5-15 s idle)."""
    import vllm.envs

    from kvpool.engine.client import new_session

    async def keepalive():
        async with new_session() as session:
            return session.connector._keepalive_timeout

    assert asyncio.run(keepalive()) < vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
