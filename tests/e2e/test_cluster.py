"""The small end-to-end matrix run through a real scheduler: a one-node SLURM cluster (Debian's
slurm-wlm and munge, started by a fixture) and Snakemake's SLURM executor plugin with kvpool's
profiles/slurm. Every job is a SLURM job; the cells must come out as valid as in a local run, with
no job and no replica left behind."""

import json
import os
import subprocess
import sys
import time

import pandas as pd
import pytest
from support import CONFIGS, REPO
from support.e2e import CELL, replicas_running_in
from support.slurm_cluster import missing_programs, single_node_cluster

# Outside the per-commit lane (docs/testing.md): `make test-full` runs it.
pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = missing_programs()
    if missing:
        # `make test-full` installs them as root: there (and in CI) a missing daemon is a failure, not a skip
        if os.environ.get("CI"):
            pytest.fail(f"the cluster test needs {', '.join(missing)} (Debian: slurm-wlm, munge)")
        pytest.skip(f"no SLURM here: {', '.join(missing)} missing (Debian: apt-get install slurm-wlm munge)")
    with single_node_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield env


def jobs_in(env, *states):
    """(job id, the rule it ran) of the cluster's jobs in ``states``: the executor writes the rule into
    each job's comment, ``rule_<name>[_wildcards_<...>]``."""
    out = subprocess.run(["squeue", "--noheader", "--states=" + ",".join(states), "--format=%i %k"],
                         env=env, capture_output=True, text=True, check=True)
    return [(job, comment.removeprefix("rule_").split("_wildcards_")[0])
            for job, comment in (line.split(maxsplit=1) for line in out.stdout.splitlines())]


def test_the_matrix_runs_as_slurm_jobs_with_valid_cells_and_nothing_left(cluster, tmp_path):
    argv = [sys.executable, "-m", "snakemake", "all", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
            "--profile", str(REPO / "profiles" / "slurm"),
            "--configfile", str(CONFIGS / "e2e.yaml"), str(CONFIGS / "e2e-cluster.yaml")]
    started = time.monotonic()
    result = subprocess.run(argv, env=cluster, capture_output=True, text=True, timeout=3600)
    print(f"through SLURM: {time.monotonic() - started:.0f} s")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    record = json.loads((tmp_path / CELL.format(backend="lmcache-fs", arm="shared") / "validity.json").read_text())
    assert record["valid"], record
    shared = pd.read_csv(tmp_path / CELL.format(backend="lmcache-fs", arm="shared") / "reuse.csv")
    assert (shared["external_hit_tokens"] == 2048).all()
    assert (shared["prefill_replica"] != shared["serve_replica"]).all()
    assert (tmp_path / "results" / "gate.ok").exists() and (tmp_path / "results" / "table1.csv").exists()
    # every rule ran as a SLURM job, the cell's timed phases once each
    rules = [rule for _, rule in jobs_in(cluster, "COMPLETED")]
    for rule in ("populate", "drop", "reuse"):
        assert rules.count(rule) == 1, rules
    assert {"model", "prompts", "reference", "plan", "validity", "table1", "gate"} <= set(rules), rules
    assert not jobs_in(cluster, "PENDING", "RUNNING", "COMPLETING", "FAILED"), "jobs left on the cluster, or failed"
    assert replicas_running_in(tmp_path) == []
