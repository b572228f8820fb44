"""A run carried to another machine by bench/device_resume.sh goes on from its finished steps: after the model,
the prompts and the reference came back and were unpacked elsewhere, Snakemake (as bench/device_run.sh runs it)
schedules the cells and nothing before them. So it does from a run committed from its first tarball alone, the
prompts and the model built again by the workflow and held to the last machine's digests."""

import os
import re
import subprocess
import sys
import tarfile
import time

from support import CONFIGS, REPO
from support.e2e import snakemake_argv

SCRIPT = str(REPO / "bench" / "device_resume.sh")


def scheduled(workdir, target):
    argv = snakemake_argv(workdir, target, CONFIGS / "e2e.yaml")
    dry = subprocess.run([*argv, "--dry-run", "--rerun-triggers=mtime", "--rerun-incomplete"],
                         capture_output=True, text=True, timeout=600)
    assert dry.returncode == 0, dry.stderr[-3000:]
    table = dry.stdout.split("Job stats:")[1].split("total")[0]
    return dict(re.findall(r"^(\w+)\s+(\d+)$", table, flags=re.MULTILINE))


def device_resume(*args):
    done = subprocess.run(["bash", SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done


def test_the_next_machine_goes_on_from_the_reference(prepared, tmp_path):
    device_resume("pack", prepared, tmp_path, "e2e")
    device_resume("unpack", tmp_path, tmp_path / "next", "e2e")

    jobs = scheduled(tmp_path / "next", "results/table1.md")
    assert jobs.get("cell") == "2", jobs
    assert not {"model", "prompts", "launch_check", "reference"} & set(jobs), jobs


def test_a_committed_run_goes_on_from_the_reference_with_its_prompts_and_model_built_again(prepared, tmp_path):
    device_resume("pack", prepared, tmp_path, "e2e")
    folder = tmp_path / "committed" / "e2e"
    with tarfile.open(tmp_path / "e2e.tar.gz") as tar:
        tar.extractall(folder, filter="data")
    assert not (folder / "results" / "workload" / "prompts.jsonl").exists() and not (folder / "resources").exists()
    now = time.time()  # a checkout's files all carry the time git wrote them
    for path in folder.rglob("*"):
        os.utime(path, (now, now))
    rebuild = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--cores", "1",
               "--configfile", str(CONFIGS / "e2e.yaml")]
    device_resume("unpack", folder, tmp_path / "next", "e2e", *rebuild)

    assert (tmp_path / "next" / "results" / "workload" / "prompts.jsonl").read_bytes() == (
        prepared / "results" / "workload" / "prompts.jsonl").read_bytes()
    jobs = scheduled(tmp_path / "next", "results/table1.md")
    assert jobs.get("cell") == "2", jobs
    assert not {"model", "prompts", "launch_check", "reference"} & set(jobs), jobs
