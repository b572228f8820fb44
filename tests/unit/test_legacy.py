"""Readers of older records: an older record reads with the value its run meant, a current one unchanged."""

import pandas as pd

from kvpool.measure import legacy


def test_an_older_config_reads_with_the_settings_its_run_had():
    assert legacy.study_b({"turns": 6}) == {"turns": 6, "windows": [], "window_turns": 4}
    assert legacy.study_b({"windows": [2], "window_turns": 3})["window_turns"] == 3
    assert legacy.peer_replay({"enabled": True}, "ascending") == {"enabled": True, "arms": ("shared", "isolated"),
                                                                 "orders": ("ascending",)}
    current = {"enabled": True, "arms": ["shared"], "orders": ["descending"]}
    assert legacy.peer_replay(current, "ascending") == current


def test_an_older_capacity_unit_reads_with_what_it_did_not_record():
    assert legacy.capacity_pool({"end": {}})["peak_kv_bytes"] == 0
    assert legacy.capacity_pool({"peak_kv_bytes": 7})["peak_kv_bytes"] == 7
    assert legacy.capacity_requests(pd.DataFrame({"ttft_s": [0.1]}))["gpu_energy_j"].isna().all()
    assert legacy.evicted_before({"doc_id": 1}, 5) == 5 and legacy.evicted_before({"evicted_before": 2.0}, 5) == 2
    assert legacy.kept_apart_unverified({"not_verified": {"pool_hits": "external"}}) == ["pool_hits"]
    assert legacy.kept_apart_unverified({"checks": {}}) == []
