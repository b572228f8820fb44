"""What a reported figure rests on: percentiles only from enough samples, intervals on proportions, means and
ratios, and claims of "no difference" only where an interval supports them."""

import numpy as np
import pandas as pd
import pytest

from kvpool.cells import Cell
from kvpool.stats import change_claim, mean_ci, proportion_ci, ratio_ci, reported_percentile
from kvpool.studies.tables import cell_row, table1


@pytest.mark.parametrize("q, n, basis", [(95, 19, "max of 19"), (95, 20, "p95"), (99, 99, "max of 99"),
                                         (99, 100, "p99"), (50, 2, "p50")])
def test_a_percentile_needs_its_samples_or_is_the_largest_one_named_so(q, n, basis):
    values = np.arange(1, n + 1, dtype=float)
    found = reported_percentile(values, q)
    assert found["basis"] == basis and found["n"] == n
    if basis.startswith("max of"):
        assert found["value"] == n and np.isnan(found["ci_low"]) and np.isnan(found["ci_high"])
    else:
        assert found["value"] == pytest.approx(np.percentile(values, q))
        assert found["ci_low"] <= found["value"] <= found["ci_high"]


def test_no_samples_report_no_value():
    found = reported_percentile([np.nan], 50)
    assert found["n"] == 0 and np.isnan(found["value"]) and found["basis"] == "no samples"


def test_a_ratio_gets_its_own_interval():
    rng = np.random.default_rng(1)
    isolated, shared = 18.4 + rng.normal(0, 0.5, 30), 2.2 + rng.normal(0, 0.1, 30)
    low, high = ratio_ci(isolated, shared)
    ratio = np.median(isolated) / np.median(shared)
    assert low <= ratio <= high and low > 1
    # the same spread on both sides of 1: the interval spans it
    low, high = ratio_ci(rng.normal(1.0, 0.1, 30), rng.normal(1.0, 0.1, 30))
    assert low < 1 < high
    assert all(np.isnan(ratio_ci([1.0], [2.0, 3.0])))          # one sample on a side: no interval
    assert all(np.isnan(ratio_ci([40.0, 41.0], [0.9, 0.88])))  # two a side (a 256K cell): none either
    assert all(np.isnan(ratio_ci(np.ones(30), np.ones(30), q=99)))  # a p99 needs 100 on each side


def test_proportions_carry_wilson_intervals():
    low, high = proportion_ci(4, 4)
    assert high == pytest.approx(1.0) and low == pytest.approx(0.5101, abs=1e-3)
    low, high = proportion_ci(50, 100)
    assert low == pytest.approx(0.4038, abs=1e-3) and high == pytest.approx(0.5962, abs=1e-3)
    assert all(np.isnan(proportion_ci(0, 0)))


def test_a_mean_interval_needs_two_values():
    assert all(np.isnan(mean_ci([0.5])))
    assert mean_ci([1.0, 1.0, 1.0]) == (1.0, 1.0)
    low, high = mean_ci([0.1, 0.2, 0.3, 0.4])
    assert low < 0.25 < high


@pytest.mark.parametrize("low, high, tolerance, said", [
    (-9.5, 7.6, 2, "no difference shown (the interval spans 0)"),   # four changes over -9.5..+7.6: not "within 2%"
    (-1.5, 1.8, 2, "within 2%"),
    (-30.2, -24.1, None, "lower"),
    (0.4, 3.0, None, "higher"),
    (np.nan, np.nan, 2, "no interval (too few samples)"),
])
def test_a_claim_is_only_what_its_interval_shows(low, high, tolerance, said):
    assert change_claim(low, high, tolerance) == said


def test_table1_gives_each_value_its_count_basis_and_the_ratio_its_interval():
    config = {"warm_s": 3.0, "slo_s": 5.0, "workload": {"doc_tokens": 1000}}
    power = {"mean_power_w": 300.0, "gpu_energy_j": 1200.0, "replicas": {}}
    rng = np.random.default_rng(0)
    ttft = {"isolated": 4.0 + rng.normal(0, 0.2, 24), "shared": 0.4 + rng.normal(0, 0.02, 24)}
    rows, samples = [], {}
    for arm, values in ttft.items():
        cell = Cell("lmcache-mp", arm, 1024, "ram")
        records = pd.DataFrame({"ttft_s": values, "error": [""] * 24, "external_hit_tokens": [900] * 24})
        rows.append(cell_row(cell, records, 10.0, power, {"valid": True, "checks": {}}, config))
        samples[cell.name] = values
    table = table1(pd.DataFrame(rows), samples).set_index("metric")
    p50, p95, p99 = table.loc["ttft_p50_s"], table.loc["ttft_p95_s"], table.loc["ttft_p99_s"]
    assert p50["isolated_n"] == p50["shared_n"] == 24 and p50["shared_basis"] == "p50"
    assert p50["ratio_ci_low"] <= p50["ratio"] <= p50["ratio_ci_high"]
    assert p95["shared_basis"] == "p95" and p99["shared_basis"] == "max of 24"
    assert np.isnan(p99["ratio_ci_low"])                    # no interval on a ratio of maxima
    reload = table.loc["reload_rate"]
    assert reload["isolated"] == 0 and reload["shared"] == 1 and reload["shared_basis"] == "proportion"
    assert reload["shared_ci_low"] == pytest.approx(proportion_ci(24, 24)[0])
    assert table.loc["mean_power_w", "shared_basis"] == "one window"


def test_a_shared_pool_of_a_server_per_replica_is_compared_with_its_backends_isolated_arm():
    config = {"warm_s": 3.0, "slo_s": 5.0, "workload": {"doc_tokens": 1000}}
    power = {"mean_power_w": 300.0, "gpu_energy_j": 1200.0, "replicas": {}}
    rows, samples = [], {}
    for cell, ttft in ((Cell("lmcache-mp", "isolated", 256, "disk"), 4.0),
                       (Cell("lmcache-mp", "shared", 256, "disk"), 2.0),
                       (Cell("lmcache-mp", "shared", 256, "disk", servers="per-replica"), 1.0)):
        values = np.full(8, ttft)
        records = pd.DataFrame({"ttft_s": values, "error": [""] * 8, "external_hit_tokens": [900] * 8})
        rows.append(cell_row(cell, records, 10.0, power, {"valid": True, "checks": {}}, config))
        samples[cell.name] = values
    table = table1(pd.DataFrame(rows), samples)
    p50 = table[table["metric"] == "ttft_p50_s"].set_index("backend")
    assert p50.loc["lmcache-mp", "ratio"] == 2.0
    assert p50.loc["lmcache-mp+servers=per-replica", "isolated"] == 4.0
    assert p50.loc["lmcache-mp+servers=per-replica", "ratio"] == 4.0
