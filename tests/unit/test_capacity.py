"""Pool capacity (kvpool.studies.capacity): the popularity draws, the capacity's setting, each follow-up's
source and silent miss, the unit's gate and the refusals."""

import numpy as np
import pandas as pd
import pytest

from kvpool.cells import Cell
from kvpool.engine import mp, pool_views
from kvpool.engine.client import RequestResult
from kvpool.engine.plan_types import ServerPlan
from kvpool.report import capacity as capacity_report
from kvpool.report import gate
from kvpool.studies import capacity, capacity_requests
from kvpool.studies.capacity_requests import Asking


@pytest.mark.parametrize("exponent", [0.7, 1.0, 1.4])
def test_the_popularity_draws_recover_their_zipf_exponent(exponent):
    ranks = capacity_requests.popularity_ranks(64, exponent, 5000, np.random.default_rng(3))
    assert ranks.min() >= 1 and ranks.max() <= 64
    assert capacity_requests.fitted_exponent(ranks, 64) == pytest.approx(exponent, abs=0.05)


def test_uniform_popularity_and_seeded_draws_independent_of_the_populate_order():
    uniform = capacity_requests.popularity_ranks(8, 0.0, 16000, np.random.default_rng(0))
    counts = np.bincount(uniform, minlength=9)[1:]
    assert counts.min() > 0.9 * 2000 and counts.max() < 1.1 * 2000
    first = capacity_requests.draws(16, 1.0, 400, seed=5)
    assert (first == capacity_requests.draws(16, 1.0, 400, seed=5)
            and first != capacity_requests.draws(16, 1.0, 400, seed=6))
    # the most drawn document is the seeded ranking's first, not populate's first (document 0)
    top = np.bincount(first).argmax()
    assert top == np.random.default_rng(5).permutation(16)[0]
    assert np.bincount(first)[top] > 400 / 16 * 3


def test_the_cap_is_the_servers_empty_overhead_plus_the_capacity():
    assert pool_views.redis_maxmemory(900_000, 18_874_368) == 900_000 + 18_874_368


def test_the_working_set_is_every_follow_up_prompt_in_whole_chunks():
    config = {"workload": {"documents": 8, "doc_tokens": 2048, "followup_tokens": 300}}
    assert capacity.working_set_tokens(config, 256) == 8 * 2304  # 2,348 tokens hold 9 whole chunks
    assert capacity.capacity_bytes(config, 256, 0.25, per_token=1024) == int(0.25 * 8 * 2304 * 1024)


def row(doc_id, external, local, before, after, error=""):
    return {"doc_id": doc_id, "external_hit_tokens": external, "local_cache_hit_tokens": local,
            "evicted_before": before, "evicted_after": after, "error": error}


def test_each_follow_up_names_its_source_and_a_recompute_with_nothing_evicted_is_a_silent_miss():
    rows = [row(0, 2048, 0, 0, 0),       # the pool served it
            row(1, 0, 0, 0, 0),          # recomputed with nothing ever evicted: silent
            row(2, 0, 0, 0, 6),          # recomputed, but (counted as of populate) nothing evicted before: silent
            row(3, 0, 0, 6, 6),          # recomputed after evictions: explained
            row(2, 0, 0, 6, 6),          # its store began at 0 and 6 were evicted since (its own chunks maybe)
            row(2, 0, 0, 6, 6),          # again: nothing evicted since its last store began: silent
            row(3, 1024, 0, 8, 8),       # partly from the pool after more evictions: explained
            row(0, 0, 2048, 8, 8),       # its own cache
            row(1, None, None, 8, 8, error="replica 1 died")]
    found = capacity.account(rows, doc_tokens=2048, min_hit_fraction=0.95, stored=dict.fromkeys(range(4), 0))
    assert [r["source"] for r in found] == ["pool", "recomputed", "recomputed", "recomputed", "recomputed",
                                           "recomputed", "partial", "own cache", None]
    assert [r["silent_miss"] for r in found] == [False, True, True, False, False, True, False, False, None]


def test_the_gate_fails_a_silent_miss_an_error_and_a_pool_that_held_more_than_its_capacity():
    frame = pd.DataFrame({"part": ["populate", "window", "window"], "prefill_replica": [0, 0, 1],
                          "serve_replica": [0, 1, 0], "error": ["", "", ""], "silent_miss": [None, False, False]})
    assert all(c["ok"] for c in capacity.unit_checks(frame, 900, 1000).values())
    over = capacity.unit_checks(frame, 1001, 1000)["held_within_capacity"]
    assert not over["ok"] and over["value"] == 1001 and over["threshold"] == 1000
    silent = capacity.unit_checks(frame.assign(silent_miss=[None, True, False]), 900, 1000)
    assert not silent["no_silent_miss"]["ok"] and silent["no_silent_miss"]["value"] == 1
    failed = capacity.unit_checks(frame.assign(error=["", "replica 1 died", ""]), 900, 1000)
    assert not failed["zero_errors"]["ok"]
    same = capacity.unit_checks(frame.assign(serve_replica=[0, 0, 0]), 900, 1000)
    assert not same["cross_replica"]["ok"]


@pytest.fixture
def config_with(config):
    """The embedded default on a shared lmcache-redis cell, with ``capacity`` settings."""
    def made(**capacity_settings):
        made_config = {**config, "backends": ["lmcache-redis"], "tiers": {"ram": "pools/ram"}, "arms": ["shared"]}
        made_config["capacity"] = {**config["capacity"], **capacity_settings}
        return made_config

    return made


def test_a_capacity_below_one_documents_kv_or_on_no_redis_cell_is_refused_with_the_numbers(config_with):
    assert capacity.problems(config_with(fractions=[0.25, 1.0])) == []
    small = capacity.problems(config_with(fractions=[0.01, 0.5]))
    assert len(small) == 1 and "[0.01]" in small[0] and "smaller than one document's KV" in small[0]
    local = config_with(fractions=[0.5])
    local.update(backends=["lmcache-local-disk"], tiers={"disk": "pools/disk"})
    (refused,) = capacity.problems(local)
    assert "needs a shared cell whose pool can be limited" in refused
    assert capacity.units(local) == []
    isolated = config_with(fractions=[0.5])
    isolated["arms"] = ["isolated"]
    assert "needs a shared cell whose pool can be limited" in capacity.problems(isolated)[0]


def test_a_working_set_the_hosts_memory_cannot_hold_is_refused(config_with, monkeypatch):
    class Small:
        total = 10_000_000

    monkeypatch.setattr(capacity.psutil, "virtual_memory", lambda: Small)
    (refused,) = capacity.problems(config_with(fractions=[0.5]))
    assert "10,000,000 bytes of RAM" in refused and "working set's KV" in refused
    # the host's RAM is the running machine's question: a plan (or a committed GPU run re-read) parses here
    assert capacity.problems(config_with(fractions=[0.5]), check_host=False) == []


def test_the_operators_number_is_where_mean_ttft_has_come_90_percent_of_the_way_from_the_recompute():
    points = pd.DataFrame({"fraction": [0.25, 0.5, 1.0], "ttft_mean_s": [0.30, 0.10, 0.05]})
    # recompute 0.30 s, full 0.05 s: the target is 0.30 - 0.9 * 0.25 = 0.075 s, between 0.5 and 1.0
    assert capacity.capacity_for_gain(points, 0.30) == pytest.approx(0.5 + (0.10 - 0.075) / 0.05 * 0.5)
    # recompute 0.12 s: the target is 0.057 s
    assert capacity.capacity_for_gain(points, 0.12) == pytest.approx(0.5 + (0.10 - 0.057) / 0.05 * 0.5)
    assert np.isnan(capacity.capacity_for_gain(points.iloc[:2], 0.30))  # no unit at full capacity
    assert np.isnan(capacity.capacity_for_gain(points, np.nan))  # nothing recomputed: no gain to measure
    assert np.isnan(capacity.capacity_for_gain(points, 0.04))  # the pool is slower than the recompute
    assert capacity.capacity_for_gain(points.assign(ttft_mean_s=[0.05, 0.05, 0.05]), 0.30) == 0.25


def test_the_capacity_table_from_unit_records(tmp_path):
    import json

    cell = Cell("lmcache-redis", "shared", 256, "ram")
    csvs, metas = [], []
    for fraction, sources, ttft in ((0.25, ["pool", "recomputed", "recomputed", "partial"], [0.05, 0.3, 0.32, 0.2]),
                                    (1.0, ["pool"] * 4, [0.05, 0.06, 0.04, 0.05])):
        frame = pd.DataFrame({"part": ["populate"] + ["window"] * 4, "source": [None, *sources],
                              "ttft_s": [0.3, *ttft], "error": [""] * 4 + ["" if fraction < 1 else "replica 1 died"],
                              "silent_miss": [None, False, False, False, False]})
        csvs.append(str(tmp_path / f"{fraction}.csv"))
        frame.to_csv(csvs[-1], index=False)
        metas.append(str(tmp_path / f"{fraction}.json"))
        held = {"capped": {"kv_bytes": int(fraction * 0.9e6)},
                "end": {"kv_bytes": int(fraction * 0.8e6), "evicted_keys": 10 if fraction < 1 else 0}}
        (tmp_path / f"{fraction}.json").write_text(json.dumps({
            "policy": "allkeys-lru", "valid": True, "capacity_bytes": int(fraction * 1e6), "pool": held,
            "summary": {"power": {}}}))
    capacity_report.run_capacity_table([(cell, 0.25), (cell, 1.0)], csvs=csvs, metas=metas,
                                       csv_out=str(tmp_path / "capacity.csv"), md_out=str(tmp_path / "capacity.md"),
                                       figures_dir=str(tmp_path / "capacity"))
    table = pd.read_csv(tmp_path / "capacity.csv").set_index("fraction")
    assert table.loc[0.25, "hit_rate"] == 0.25 and table.loc[0.25, "recomputed"] == 3
    assert table.loc[0.25, "hit_rate_low"] < 0.25 < table.loc[0.25, "hit_rate_high"]
    assert table.loc[1.0, "hit_rate"] == 1.0 and table.loc[1.0, "evicted_keys"] == 0
    # a failed follow-up is counted as such, outside the hit rate
    assert table.loc[1.0, "errors"] == 1 and table.loc[1.0, "requests"] == 3 and table.loc[0.25, "errors"] == 0
    assert table.loc[0.25, "held_kv_bytes"] == 225000 and table.loc[0.25, "capacity_bytes"] == 250000
    # the recompute's TTFT from the two recomputed follow-ups (not the partial one)
    assert table["recompute_ttft_p50_s"].eq(0.31).all() and table["recomputes_measured"].eq(2).all()
    assert table["recompute_ttft_mean_s"].eq(0.31).all()
    assert table.loc[0.25, "ttft_mean_s"] == pytest.approx((0.05 + 0.3 + 0.32 + 0.2) / 4)
    low, high = table.loc[0.25, "ttft_mean_ci_low_s"], table.loc[0.25, "ttft_mean_ci_high_s"]
    assert low < table.loc[0.25, "ttft_mean_s"] < high
    assert 0.25 < table.loc[1.0, "capacity_for_90pct_gain"] <= 1.0
    page = (tmp_path / "capacity.md").read_text()
    assert "25% [" in page and "90% of the gain in mean TTFT at capacity 1" in page and "1 of 4" in page
    assert (tmp_path / "capacity" / "capacity.png").stat().st_size > 0


def test_a_run_of_capacity_units_alone_is_gated_on_them(tmp_path):
    units = pd.DataFrame({"cell": ["backend~lmcache-redis/arm~shared/chunk~256/tier~ram"] * 2,
                          "fraction": [0.25, 1.5], "valid": [False, True]})
    units.to_csv(tmp_path / "capacity.csv", index=False)
    with pytest.raises(SystemExit, match=r"1 units \(the run has no cell\) failed the validity gate") as failed:
        gate.gate(None, None, str(tmp_path / "gate.ok"), capacity_csv=str(tmp_path / "capacity.csv"))
    assert "capacity~0.25: its unit.json names the failed checks" in str(failed.value)
    units.assign(valid=True).to_csv(tmp_path / "capacity.csv", index=False)
    gate.gate(None, None, str(tmp_path / "gate.ok"), capacity_csv=str(tmp_path / "capacity.csv"))
    assert "2 capacity units valid" in (tmp_path / "gate.ok").read_text()


def test_an_mp_pool_evicting_during_populate_counts_each_documents_store_from_its_own_start():
    # the MP server's L1 is the capacity from its start: populate stored document 0 with nothing evicted, and
    # 5 chunks were evicted before document 1's store began
    populated = [{"doc_id": 0, "evicted_before": 0}, {"doc_id": 1, "evicted_before": 5}]
    stored = capacity.store_marks(populated, default=0)
    assert stored == {0: 0, 1: 5}
    found = capacity.account([row(0, 0, 0, 5, 5), row(1, 0, 0, 5, 5)], doc_tokens=2048, min_hit_fraction=0.95,
                             stored=stored)
    # document 0 may have lost its chunks to those 5 evictions; document 1 was stored after them: silent
    assert [r["silent_miss"] for r in found] == [False, True]
    # a unit recorded before populate read its evictions (populate ran with no limit) takes the default
    assert capacity.store_marks([{"doc_id": 3, "evicted_before": float("nan")}], default=7) == {3: 7}


@pytest.mark.parametrize("limit", [1, 2**30, 3 * 2**30 + 12345, int(0.25 * 16 * 16384 * 65536)])
def test_the_mp_servers_l1_is_the_capacity_rounded_down(limit):
    gib = mp.l1_size_gib_for(limit)
    l1_bytes = int(float(f"{gib:g}") * 2**30)  # what LMCache takes from --l1-size-gb (mp.server_argv's format)
    assert l1_bytes <= limit and limit - l1_bytes <= 1e-4 * 2**30 + 1


class StandInMPServer:
    """An MP server's /metrics as a capacity unit reads them: a scripted sequence, the last repeated."""

    def __init__(self, readings, l1_size_gib=1.0):
        self.readings, self.calls = list(readings), 0
        self.entry = ServerPlan(index=0, kind="lmcache", host="127.0.0.1", port=1, http_port=2, env={}, argv=[],
                                l1_size_gib=l1_size_gib)

    def metrics(self):
        reading = self.readings[min(self.calls, len(self.readings) - 1)]
        self.calls += 1
        return reading


def mp_reading(written, evicted, ticks, held=0):
    return {pool_views.MPPool.WRITTEN: written, pool_views.MPPool.EVICTED: evicted, pool_views.MPPool.TICKS: ticks,
            pool_views.MPPool.HELD: held}


def test_an_mp_pool_settles_after_two_eviction_ticks_without_a_write_and_keeps_its_peak():
    server = StandInMPServer([mp_reading(10, 0, 1, held=500), mp_reading(12, 0, 1, held=700),
                              mp_reading(12, 3, 2, held=400),  # the loop evicted 3 chunks
                              mp_reading(12, 3, 3, held=400), mp_reading(12, 3, 4, held=400),
                              mp_reading(99, 9, 9)])  # never read: settled before it
    pool = pool_views.MPPool(server)
    assert pool.settled(poll_s=0) == 3
    assert server.calls == 5 and pool.peak_kv_bytes == 700
    # nothing written or evicted since it settled: returned at once, one read
    server.readings = [mp_reading(12, 3, 4, held=400)]
    server.calls = 0
    assert pool.settled(poll_s=0) == 3 and server.calls == 1
    assert pool.limit({}, 2**30, "LRU") == {"l1_size_bytes": 2**30, "policy": "LRU"}
    # the held check reads the peak too: a pool that passed its capacity between the state reads fails
    record = {"capped": {"kv_bytes": 400}, "end": {"kv_bytes": 400}, "peak_kv_bytes": pool.peak_kv_bytes}
    assert capacity.held_kv_bytes(record) == 700


def test_an_mp_cell_on_a_memory_tier_takes_capacity_units_and_a_drive_tier_is_refused(config_with, monkeypatch):
    made = config_with(fractions=[0.25, 1.0])
    made.update(backends=["lmcache-mp"], lmcache_mp={**made["lmcache_mp"], "memory_tiers": ["ram"]})
    assert capacity.problems(made) == []
    ((cell, _), _) = capacity.units(made)
    assert cell.backend == "lmcache-mp" and capacity.eviction_policy(made, cell) == made["lmcache_mp"][
        "eviction_policy"]
    limit = capacity.capacity_bytes(made, cell.chunk, 0.25, 65536)
    argv = mp.server_argv(capacity.limited_config(made, cell, limit), cell, "127.0.0.1", 5555, 8080, None)
    assert argv[argv.index("--l1-size-gb") + 1] == f"{mp.l1_size_gib_for(limit):g}"
    # the unit's step is handed the MP server's settings; a Redis unit's is not
    wildcards = {"backend": "lmcache-mp", "arm": "shared", "chunk": str(cell.chunk), "tier": "ram"}
    monkeypatch.setattr(Cell, "from_wildcards", classmethod(lambda cls, wc: Cell(wc["backend"], wc["arm"],
                                                                                    int(wc["chunk"]), wc["tier"])))
    assert "lmcache_mp" in capacity._unit_sections(made, wildcards)
    assert "lmcache_mp" not in capacity._unit_sections(made, {**wildcards, "backend": "lmcache-redis"})
    drive = {**made, "tiers": {"disk": "pools/disk"}}
    (refused,) = capacity.problems(drive)
    assert "memory tier" in refused and "L2 folder" in refused


def test_an_mp_l1_the_hosts_memory_cannot_hold_is_refused_at_the_largest_capacity(config_with, monkeypatch):
    made = config_with(fractions=[0.25, 1.0])
    made.update(backends=["lmcache-mp"], lmcache_mp={**made["lmcache_mp"], "memory_tiers": ["ram"]})
    whole = capacity.capacity_bytes(made, made["chunk_sizes"][0], 1.0,
                                    capacity.engine_pool_bytes_per_token(made))

    class Small:
        total = int(whole * 1.5)  # half of it holds a quarter of the working set, not all of it

    monkeypatch.setattr(capacity.psutil, "virtual_memory", lambda: Small)
    (refused,) = capacity.problems(made)
    assert "at capacity 1 is the MP server's L1" in refused
    made["capacity"]["fractions"] = [0.25, 0.5]
    assert capacity.problems(made) == []


def test_the_operators_number_reads_the_mean_because_a_two_mode_median_flips_at_half_hits():
    hits, recomputes = [0.05] * 6, [0.5] * 4  # 60% from the pool
    half = pd.Series(hits + recomputes)
    assert half.median() == 0.05  # the median already shows the whole gain
    points = pd.DataFrame({"fraction": [0.5, 1.0], "ttft_mean_s": [half.mean(), 0.05]})
    # the mean has come 60% of the way at 0.5: 90% lies between 0.5 and 1.0
    assert 0.5 < capacity.capacity_for_gain(points, 0.5) < 1.0


def test_energy_per_follow_up_is_each_requests_own_and_a_window_figure_is_marked_as_such():
    window = pd.DataFrame({"gpu_energy_j": [40.0, 44.0, 60.0, 36.0]})
    own = capacity.follow_up_energy(window, {"energy_per_request_j": 130.0})
    assert own["energy_per_request_j"] == 45.0 and own["energy_basis"] == "request"
    assert own["energy_per_request_ci_low_j"] < 45.0 < own["energy_per_request_ci_high_j"]
    # a unit recorded before requests read their own energy: the window's, waits included, without interval
    older = capacity.follow_up_energy(pd.DataFrame({"ttft_s": [0.1]}), {"energy_per_request_j": 130.0})
    assert older["energy_per_request_j"] == 130.0 and older["energy_basis"] == "window"
    assert np.isnan(older["energy_per_request_ci_low_j"])
    cpu = capacity.follow_up_energy(pd.DataFrame({"gpu_energy_j": [None, None]}), {})
    assert cpu["energy_basis"] == "none" and cpu["energy_per_request_j"] is None


def test_a_follow_ups_energy_is_read_around_the_request_alone(monkeypatch):
    import asyncio

    counter = iter([100.0, 142.5])  # the GPUs' energy counter before and after the request

    class Pool(pool_views.ServerPool):
        def settled(self):
            return 0

    async def answered(session, replica, prompt, output_tokens, timeout_s):
        return RequestResult(ttft_s=0.1, e2e_s=0.2), {"external_hit_tokens": 2048}

    monkeypatch.setattr(capacity_requests, "measured_request", answered)
    monkeypatch.setattr(capacity_requests, "request_row", lambda doc, prefill, serve, result, counts: {
        "doc_id": doc, "prefill_replica": prefill, "serve_replica": serve, **counts})

    class Replica:
        def __init__(self, index):
            self.index = index

    workload = [{"doc_id": 0, "document": [1], "followup": [1, 2]}, {"doc_id": 1, "document": [3], "followup": [3]}]
    cfg = {"workload": {"output_tokens": 1}, "engine": {"request_timeout_s": 5}}
    ask = Asking([Replica(0), Replica(1)], workload, cfg, Pool(), energy=lambda: next(counter))
    (row,) = asyncio.run(ask.followups([0], "window", 0, reset_own_cache=False))
    assert row["gpu_energy_j"] == 42.5 and row["serve_replica"] == 1 and row["prefill_replica"] == 0


def test_the_tables_silent_misses_are_the_ones_its_gate_counts():
    """A server too small for its working set misses silently in the warm-up as in the window: the table's
    silent_misses column counts, from the same records, what the unit's no_silent_miss check counted."""
    frame = pd.DataFrame({"part": ["populate", "warmup", "warmup", "warmup", "window", "window"],
                          "prefill_replica": [0, 0, 1, 0, 1, 0], "serve_replica": [0, 1, 0, 1, 0, 1],
                          "error": [""] * 6, "source": [None, "recomputed", "recomputed", "recomputed", "pool", "pool"],
                          "silent_miss": [None, True, True, True, False, False], "ttft_s": [0.3] * 6})
    meta = {"policy": "allkeys-lru", "valid": False, "capacity_bytes": 1000,
            "pool": {"capped": {"kv_bytes": 900}, "end": {"kv_bytes": 900, "evicted_keys": 0}}, "summary": {}}
    checked = capacity.unit_checks(frame, 900, 1000)["no_silent_miss"]
    row = capacity.unit_row(Cell("lmcache-redis", "shared", 256, "ram"), 0.25, frame, meta)
    assert checked["value"] == 3 and not checked["ok"]
    assert row["silent_misses"] == checked["value"]
