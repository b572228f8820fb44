"""What the end-to-end tests run and read alike: Snakemake on a working directory, the e2e cell's path,
the prerequisites (model, prompts, reference) copied into a fresh directory, and the replicas left."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil

from support import CONFIGS, REPO

CELL = "results/cells/backend~{backend}/arm~{arm}/chunk~256/tier~disk"
# What a Study A run of e2e.yaml's workload builds before its cells: the random model, the prompts and
# the recompute reference (a fleet of its own).
PREREQUISITES = ("resources", "results/workload", "results/reference", "results/launch-check.json")


def capacity_unit(run: Path, cell: str, fraction: str) -> tuple[pd.DataFrame, dict]:
    """A capacity unit of ``cell`` (its ``results/cells/...`` path) in ``run``: its request rows and its unit.json."""
    folder = run / cell / f"capacity~{fraction}"
    return pd.read_csv(folder / "requests.csv"), json.loads((folder / "unit.json").read_text())


def snakemake_argv(workdir, target, *configfiles):
    # the target goes first: --configfile takes every value after it
    return [sys.executable, "-m", "snakemake", target, "-s", str(REPO / "Snakefile"), "--directory", str(workdir),
            "--cores", "1", "--configfile", *map(str, configfiles)]


def snakemake(workdir, *configfiles, target="all"):
    return subprocess.run(snakemake_argv(workdir, target, *configfiles), capture_output=True, text=True,
                          timeout=3600)


def copy_prerequisites(built: Path, workdir: Path, parts=PREREQUISITES) -> Path:
    """``parts`` of a run that built them, copied with their times kept, so Snakemake in ``workdir`` sees
    them up to date and measures from its plans on."""
    for part in parts:
        if (built / part).is_dir():
            shutil.copytree(built / part, workdir / part)
        else:
            (workdir / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(built / part, workdir / part)
    return workdir


def measured_run(workdir: Path, overlay: str, target: str, *, base="e2e.yaml") -> Path:
    """``workdir`` after ``target`` of ``base`` with ``overlay`` (tests/configs) on top."""
    result = snakemake(workdir, CONFIGS / base, CONFIGS / overlay, target=target)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return workdir


def replicas_running_in(workdir):
    found = []
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "vllm.entrypoints" in cmdline and proc.info["cwd"] == str(workdir):
            found.append(proc.pid)
    return found


def wait_for_line(proc, log, phase, line="fleet of 2 healthy"):
    """Until ``phase``'s log has ``line`` (by default: its fleet is up); fails if the run ends first or
    takes over 10 minutes."""
    deadline = time.monotonic() + 600
    while not (log.exists() and line in log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, f"{phase} never logged {line!r}"
        time.sleep(0.2)
