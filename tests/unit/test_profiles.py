"""The cluster profiles parse and plan with their executor plugins installed: a dry run of the
matrix through profiles/slurm and profiles/kubernetes. (The SLURM profile also runs for real on a
one-node cluster, tests/e2e/test_cluster.py; the Kubernetes one has not run on a cluster.)"""

import subprocess
import sys

import pytest
import yaml
from support import REPO

CONFIGS = REPO / "tests" / "configs"


def dry_run(workdir, profile, *extra):
    argv = [sys.executable, "-m", "snakemake", "all", "-n", "-s", str(REPO / "Snakefile"), "--directory", str(workdir),
            "--profile", str(REPO / "profiles" / profile), *extra,
            "--configfile", str(CONFIGS / "e2e.yaml"), str(CONFIGS / "e2e-cluster.yaml")]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("profile", "extra"), [
    ("slurm", []),
    ("kubernetes", ["--container-image", "registry.invalid/kvpool:test"]),
])
def test_a_profile_plans_every_timed_phase_of_the_matrix(tmp_path, profile, extra):
    result = dry_run(tmp_path, profile, *extra)
    assert result.returncode == 0, result.stderr[-4000:]
    said = result.stdout + result.stderr
    for rule in ("cell", "validity", "gate"):  # a cell's populate, drop and reuse: one job on one fleet
        assert f"rule {rule}:" in said or f"localrule {rule}:" in said, rule
    assert "This was a dry-run" in said


def test_the_slurm_profile_gives_every_timed_phase_a_node_of_its_own():
    profile = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    timed = ("populate", "drop", "reuse", "cell", "load_level", "studyb_block", "reference", "ceiling")
    for rule in timed:
        assert "--exclusive" in profile["set-resources"][rule]["slurm_extra"], rule
    # the fleet token of the default profile still keeps timed phases apart; squeue needs no accounting
    assert profile["slurm-status-command"] == "squeue"


def test_a_bare_command_runs_on_the_default_profiles_one_core(tmp_path):
    """`snakemake <target>` with no --cores, as the README has it: the workflow profile gives the core,
    where Snakemake alone stops with "cores have to be specified for local execution"."""
    (tmp_path / "resources" / "model").mkdir(parents=True)  # up to date: the run has nothing to build
    argv = [sys.executable, "-m", "snakemake", "resources/model", "-s", str(REPO / "Snakefile"),
            "--directory", str(tmp_path), "--configfile", str(CONFIGS / "e2e.yaml")]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Nothing to be done" in result.stdout + result.stderr
