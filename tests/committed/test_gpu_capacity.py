"""The committed H200 capacity run (config/h200-mp-capacity.yaml: two packed vLLM replicas, the shared
lmcache-mp pool whose L1 is the capacity, Zipf-drawn follow-ups), re-read by the pipeline's own code:
each unit's sources and silent misses accounted again from its rows, its gate again, capacity.csv and
.md rebuilt byte for byte, and the findings docs/results/h200-mp-capacity/README.md states."""

from pathlib import Path

import pandas as pd
import pytest

from kvpool.cells import Cell
from kvpool.measure.checks import verdict
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records
from kvpool.report import capacity as capacity_report
from kvpool.studies import capacity

RUN = Path(__file__).resolve().parents[2] / "docs" / "results" / "h200-mp-capacity"
CELL = Cell("lmcache-mp", "shared", 256, "ram")
FRACTIONS = [0.25, 0.5, 0.75, 1.0, 1.5]
PER_TOKEN = 32 * 2 * 4 * 128 * 2  # the random Llama: 32 layers x (K, V) x 4 KV heads x 128 x bf16
WORKING_SET = 24 * ((16384 + 256) // 256 * 256) * PER_TOKEN


def unit_dir(fraction: float) -> Path:
    return RUN / "results" / "cells" / CELL.name / f"capacity~{capacity.unit_label(fraction)}"


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_each_unit_is_judged_again_from_its_rows(fraction):
    meta, rows = read_json(unit_dir(fraction) / "unit.json"), read_records(str(unit_dir(fraction) / "requests.csv"))
    config = read_json(unit_dir(fraction) / "manifest.json")["config"]
    populate, asked = rows[rows["part"] == "populate"], rows[rows["part"] != "populate"]
    # the L1 evicts during populate: each document's store counts from its own populate request
    stored = capacity.store_marks(populate.to_dict("records"), meta["pool"]["populated"]["evicted_keys"])
    recounted = capacity.account(asked.drop(columns=["source", "silent_miss"]).to_dict("records"),
                                 config["workload"]["doc_tokens"], config["min_hit_fraction"], stored)
    assert [r["source"] for r in recounted] == [None if pd.isna(s) else s for s in asked["source"]]
    assert [r["silent_miss"] for r in recounted] == list(asked["silent_miss"].astype(bool))
    again = capacity.unit_checks(rows, capacity.held_kv_bytes(meta["pool"]), meta["capacity_bytes"])
    assert {name: c["ok"] for name, c in again.items()} == {
        name: c["ok"] for name, c in meta["checks"].items() if name in again}
    assert verdict(again) == meta["valid"]
    # the capacity is the working set's KV times the fraction, and the server's L1 was that, rounded down
    assert meta["capacity_bytes"] == int(fraction * WORKING_SET)
    l1 = meta["pool"]["l1_size_bytes"]
    assert l1 <= meta["capacity_bytes"] < l1 + 1e-4 * 2**30 + 1
    assert capacity.held_kv_bytes(meta["pool"]) <= l1  # the L1 in use never passed its size, in any read


def test_the_table_is_rebuilt_from_the_records(tmp_path):
    units = [(CELL, f) for f in FRACTIONS]
    capacity_report.run_capacity_table(units, csvs=[str(unit_dir(f) / "requests.csv") for f in FRACTIONS],
                                       metas=[str(unit_dir(f) / "unit.json") for f in FRACTIONS],
                                       csv_out=str(tmp_path / "capacity.csv"), md_out=str(tmp_path / "capacity.md"),
                                       figures_dir=str(tmp_path / "capacity"))
    for name in ("capacity.csv", "capacity.md"):
        assert (tmp_path / name).read_text() == (RUN / "results" / name).read_text()


def test_lmcache_evicts_before_its_l1_is_full_so_the_whole_working_set_needs_more_than_its_size():
    shown = pd.read_csv(RUN / "results" / "capacity.csv").set_index("fraction")
    assert shown["valid"].all() and (shown["silent_misses"] == 0).all() and (shown["errors"] == 0).all()
    assert shown["hit_rate"].is_monotonic_increasing
    # an L1 the size of the working set holds about 80% of it (LMCache's eviction watermark) and serves 75%;
    # half again as large serves every follow-up and evicts nothing
    assert shown.loc[1.0, "held_kv_bytes"] < 0.85 * shown.loc[1.0, "capacity_bytes"]
    assert shown.loc[1.0, "hit_rate"] < 1.0 and shown.loc[1.0, "evicted_keys"] > 0
    assert shown.loc[1.5, "hit_rate"] == 1.0 and shown.loc[1.5, "evicted_keys"] == 0
    assert shown.loc[0.25, "hit_rate_high"] < shown.loc[1.5, "hit_rate_low"]
    # the mean TTFT falls with every step; the median has already fallen at 0.5, its interval reaching the
    # recompute: the operator's number reads the mean, and lies between 1.0 and 1.5
    assert shown.loc[0.25, "ttft_mean_ci_low_s"] > shown.loc[1.5, "ttft_mean_ci_high_s"]
    assert shown.loc[0.5, "ttft_p50_s"] < 0.2 < shown.loc[0.5, "ttft_p50_ci_high_s"]
    assert 1.0 < shown["capacity_for_90pct_gain"].iloc[0] < 1.5
    # units recorded before requests read their own energy: the window's figure, marked so
    assert (shown["energy_basis"] == "window").all()


def test_the_quarter_l1_dropped_stores_it_had_no_room_for():
    logs = RUN / "logs" / "capacity" / CELL.name
    dropped = {f: (logs / f"capacity~{capacity.unit_label(f)}" / "lmcache-server-0.log").read_text()
               .count("Failed to batched allocate") for f in FRACTIONS}
    assert dropped[0.25] > 0 and all(dropped[f] == 0 for f in FRACTIONS if f > 0.25)
