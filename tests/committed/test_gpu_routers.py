"""The committed H200 routers run (docs/results/h200-mp-routers: three replicas packed on one H200, the
7.1B random Llama, 12 documents of 16,384 tokens, LMCache's MP server with a host-RAM L1, both arms,
prefix-affinity and round-robin), re-read by the pipeline's own code: every unit's gate again, the table
again from the records, and the findings its README states."""

from pathlib import Path

import pandas as pd
import pytest
from support.committed import assert_same_gate, measured_only_rebuild, rebuild_router_table, router_checks_again

from kvpool.cells import Cell

RUN = Path(__file__).resolve().parents[2] / "docs" / "results" / "h200-mp-routers"
CELLS = [Cell("lmcache-mp", arm, 256, "ram") for arm in ("shared", "isolated")]
MEASURED = ("prefix-affinity", "round-robin")
UNITS = [(cell, router) for cell in CELLS for router in MEASURED]


@pytest.mark.parametrize(("cell", "router"), UNITS, ids=[f"{c.arm}-{r}" for c, r in UNITS])
def test_every_unit_ran_on_the_gpu_and_is_valid_again_from_its_records(cell, router):
    meta, manifest, again = router_checks_again(RUN, cell, router)
    config = manifest["config"]
    assert manifest["git"]["commit"] == "fe7964e6e09f0a364b29399d530ba695282f9253"
    assert manifest["versions"]["vllm"] == "0.26.0" and manifest["hardware"]["gpu"]["devices"] == ["NVIDIA H200"]
    assert config["replicas"] == 3 and config["engine"]["replicas_per_gpu"] == 3 and meta["loss"]["replica"] == 2
    # today's gate also holds the answers to a split-matched recompute; this run computed none (no
    # results/reference), so they are not verified, and the hot phase's three in flight are not either
    assert_same_gate(meta["checks"], again["checks"], new={"output_matches_recompute", "hot_outputs_match_recompute"})
    assert again["checks"]["output_matches_recompute"]["value"]["unmatched"] == 24
    assert {c["status"] for name, c in again["checks"].items() if "outputs" in name} == {"not_verified"}
    assert again["valid"] and meta["valid"]


def test_the_table_rebuilds_from_the_records(tmp_path):
    rebuild_router_table(RUN, UNITS, tmp_path)
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "routers.csv"), pd.read_csv(RUN / "results" / "routers.csv"),
                                  rtol=1e-9)
    assert (tmp_path / "routers.md").read_text() == (RUN / "results" / "routers.md").read_text()
    assert (tmp_path / "routers" / "ttft.png").stat().st_size > 0


def test_the_findings_the_readme_states():
    rows = pd.read_csv(RUN / "results" / "routers.csv")
    table = rows[rows["group"] == "all"].set_index(["arm", "router", "phase"])
    follow = table.xs("follow-up", level="phase")
    # round-robin's isolated follow-ups: own-cache hits (stayed) and recomputes (moved), two populations; the
    # p50 of all 12 lies between them, where no request was
    split = rows[(rows["arm"] == "isolated") & (rows["router"] == "round-robin") & (rows["phase"] == "follow-up")]
    by_group = split.set_index("group")["ttft_p50_s"]
    assert by_group["stayed"] < 0.15 < by_group["all"] < 0.45 < by_group["moved"]
    # every replica up: affinity's own cache answers with or without the pool
    assert follow.loc[("isolated", "prefix-affinity"), "local_cache_fraction"] > 0.95
    assert follow.loc[("isolated", "prefix-affinity"), "ttft_p50_s"] <= follow.loc[("shared", "round-robin"),
                                                                                    "ttft_p50_s"]
    # without affinity only the shared pool helps: half of round-robin's follow-ups are recomputed
    assert follow.loc[("isolated", "round-robin"), "computed_fraction"] > 0.45
    assert follow.loc[("isolated", "round-robin"), "ttft_p50_s"] > 3 * follow.loc[("shared", "round-robin"),
                                                                                  "ttft_p50_s"]
    # a lost replica moves a third of affinity's documents: recomputed without the pool, reloaded with it
    lost = table.xs("after-loss", level="phase")
    assert lost.loc[("isolated", "prefix-affinity"), "computed_fraction"] > 0.3
    assert lost.loc[("shared", "prefix-affinity"), "pool_fraction"] > 0.3
    assert lost.loc[("isolated", "prefix-affinity"), "ttft_p99_s"] > 4 * lost.loc[("shared", "prefix-affinity"),
                                                                                 "ttft_p99_s"]
    # hot documents: affinity puts most on one replica, and queues there behind round-robin with the pool
    hot = table.xs("hot", level="phase")
    assert hot.loc[("shared", "prefix-affinity"), "max_replica_share"] > 0.75
    assert hot.loc[("shared", "round-robin"), "max_replica_share"] < 0.34
    assert hot.loc[("shared", "prefix-affinity"), "ttft_p50_s"] > 1.2 * hot.loc[("shared", "round-robin"), "ttft_p50_s"]


def test_measured_only_rebuilds_the_page_of_a_run_with_router_units_alone(tmp_path):
    """A working directory with router units and no Study A cell: measured_only builds routers.md from
    them, for the routers the run measured (it used to refuse such a directory)."""
    work = measured_only_rebuild(RUN, "h200-mp-routers.yaml", "results/routers.md", "results/routers.md", tmp_path)
    assert (work / "results" / "routers.md").read_text() == (RUN / "results" / "routers.md").read_text()
