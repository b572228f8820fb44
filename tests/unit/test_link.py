"""The host-to-GPU link's ceiling (kvpool.measure.link) and the reload held against it in Table 2 and the
load table. CI has no GPU: the GPU path's figures come from the committed H200 run; here its arithmetic and
the CPU path, which must say that it measured a host memory copy and that the link does not apply."""
import math

import numpy as np
import pandas as pd
import pytest

from kvpool.cells import Cell
from kvpool.measure import link
from kvpool.studies import tables


def test_a_copy_rate_is_the_median_of_its_timed_copies_with_the_slowest_and_fastest():
    found = link.rate(16 << 20, [0.001, 0.002, 0.0004, 0.001, 0.001])
    assert found["n"] == 5 and found["bytes"] == 16 << 20
    assert found["gb_per_s"] == pytest.approx((16 << 20) / 0.001 / 1e9)
    assert found["min_gb_per_s"] == pytest.approx((16 << 20) / 0.002 / 1e9)
    assert found["max_gb_per_s"] == pytest.approx((16 << 20) / 0.0004 / 1e9)


def test_without_a_gpu_the_ceiling_says_the_link_does_not_apply_and_what_it_measured_instead():
    found = link.ceiling([], [256 * 4096], repeats=2)
    assert not found["applicable"] and found["gb_per_s"] is None
    assert found["measured"] == "host memory copy" and "no CUDA GPU" in found["why"]
    # one stored chunk's KV and the large size, each measured, never assumed
    assert [copy["bytes"] for copy in found["copies"]] == [256 * 4096, link.LARGE_BYTES]
    assert all(copy["n"] == 2 and copy["gb_per_s"] > 0 for copy in found["copies"])
    assert math.isnan(link.efficiency(10.0, found)) and math.isnan(link.efficiency(10.0, None))
    assert link.efficiency(18.5, {"applicable": True, "gb_per_s": 52.5}) == pytest.approx(18.5 / 52.5)


def _records(hits, ttfts, errors=None):
    return pd.DataFrame({"external_hit_tokens": hits, "ttft_s": ttfts,
                         "error": errors or [None] * len(hits)})


def test_a_reload_rate_is_the_kv_a_follow_up_loaded_over_its_ttft():
    rates = tables.reload_rates(_records([8192, 8192, 0, 8192], [0.5, 1.0, 2.0, 9.0], [None, None, None, "500"]),
                                per_token=4096)
    # the one that loaded nothing and the one that failed are left out
    assert list(rates) == pytest.approx([8192 * 4096 / 0.5 / 1e9, 8192 * 4096 / 1.0 / 1e9])


def _tier_frame(ceiling):
    summary = {"drive": {"available": False}, "health_after": []}
    records = _records([8192] * 5, [0.2, 0.25, 0.3, 0.35, 0.4])
    row = tables.tier_row(Cell("lmcache-mp", "shared", 256, "ram"), summary, records, pd.DataFrame(), ceiling,
                          per_token=4096)
    return tables.tier_compare(pd.DataFrame([row])).set_index("signal")


def test_table_2_holds_a_memory_tier_s_reload_against_the_link_where_the_ceiling_measured_it():
    ceiling = {"gb_per_s": 9.0, "method": "read", "link": {"applicable": True, "gb_per_s": 52.5}}
    table = _tier_frame(ceiling)
    reload = 8192 * 4096 / 0.3 / 1e9  # the median follow-up's
    assert table.loc["reload_gb_per_s", "ram"] == pytest.approx(reload)
    assert table.loc["link_ceiling_gb_per_s", "ram"] == 52.5
    assert table.loc["link_efficiency", "ram"] == pytest.approx(reload / 52.5)
    # a ceiling from before kvpool measured the link: Table 2 as it was, no link rows
    assert "link_efficiency" not in _tier_frame({"gb_per_s": 9.0, "method": "read"}).index
    on_cpu = _tier_frame({**ceiling, "link": link.ceiling([], [], repeats=1)})
    assert np.isnan(on_cpu.loc["link_efficiency", "ram"]) and on_cpu.loc["reload_gb_per_s", "ram"] > 0
