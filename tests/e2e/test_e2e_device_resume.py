"""A run carried to another machine by bench/device_resume.sh goes on from its finished steps: after the model,
the prompts and the reference came back and were unpacked elsewhere, Snakemake (as bench/device_run.sh runs it)
schedules the cells and nothing before them."""

import re
import subprocess

from support import CONFIGS, REPO
from support.e2e import snakemake_argv


def scheduled(workdir, target):
    argv = snakemake_argv(workdir, target, CONFIGS / "e2e.yaml")
    dry = subprocess.run([*argv, "--dry-run", "--rerun-triggers=mtime", "--rerun-incomplete"],
                         capture_output=True, text=True, timeout=600)
    assert dry.returncode == 0, dry.stderr[-3000:]
    table = dry.stdout.split("Job stats:")[1].split("total")[0]
    return dict(re.findall(r"^(\w+)\s+(\d+)$", table, flags=re.MULTILINE))


def test_the_next_machine_goes_on_from_the_reference(prerequisites, tmp_path):
    script = str(REPO / "bench" / "device_resume.sh")
    packed = subprocess.run(["bash", script, "pack", str(prerequisites), str(tmp_path), "e2e"],
                            capture_output=True, text=True, timeout=300)
    assert packed.returncode == 0, packed.stderr
    unpacked = subprocess.run(["bash", script, "unpack", str(tmp_path), str(tmp_path / "next"), "e2e"],
                              capture_output=True, text=True, timeout=300)
    assert unpacked.returncode == 0, unpacked.stderr

    jobs = scheduled(tmp_path / "next", "results/table1.md")
    assert jobs.get("cell") == "2", jobs
    assert not {"model", "prompts", "launch_check", "reference"} & set(jobs), jobs
