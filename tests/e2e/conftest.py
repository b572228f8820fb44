"""The end-to-end tests' shared builds. Each is made once a session and copied into the runs that need it,
so no test depends on another having run, or on the order they run in."""

import subprocess

import pytest
from support import CONFIGS
from support.e2e import copy_prerequisites, snakemake, snakemake_argv


@pytest.fixture(scope="session")
def prerequisites(tmp_path_factory):
    """e2e.yaml's model, prompts and recompute reference, built once."""
    workdir = tmp_path_factory.mktemp("prerequisites")
    built = subprocess.run(snakemake_argv(workdir, "results/reference/outputs.csv", CONFIGS / "e2e.yaml"),
                           capture_output=True, text=True, timeout=1800)
    assert built.returncode == 0, built.stderr[-4000:]
    return workdir


@pytest.fixture
def prepared(tmp_path, prerequisites):
    """A fresh working directory holding the session's prerequisites."""
    return copy_prerequisites(prerequisites, tmp_path)


@pytest.fixture(scope="session")
def study_run(tmp_path_factory, prerequisites):
    """e2e.yaml's whole pipeline (`all`): Study A's two arms, their load level and vLLM's replay, Study B's
    blocks, the tables and the page. Several modules assert on it; none changes it."""
    workdir = copy_prerequisites(prerequisites, tmp_path_factory.mktemp("e2e"))
    result = snakemake(workdir, CONFIGS / "e2e.yaml")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return workdir
