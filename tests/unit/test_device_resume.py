"""bench/device_resume.sh: a run carried from one lent machine to the next keeps its finished steps' files and
times, leaves out what cannot come back, and refuses to unpack where it would overwrite or could not go on."""

import json
import os
import subprocess

import pytest
from support import REPO

SCRIPT = str(REPO / "bench" / "device_resume.sh")
OLD = 1_700_000_000  # a finished step's time, which the next machine must see unchanged


def device_resume(*args):
    return subprocess.run(["bash", SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=120)


def finished_run(work, weights="drawn", weight_bytes=0):
    """A working directory as a device run leaves it: a reference, the prompts, the model, a log."""
    files = {
        "results/reference/outputs.csv": "request,text\n0,abc\n",
        "results/workload/prompts.jsonl": '{"id": 0}\n',
        "resources/model/config.json": "{}",
        "resources/model/kvpool-model.json": json.dumps({"weights": weights}, indent=2),
        "logs/reference/reference.log": "fleet of 1 healthy\n",
    }
    for name, text in files.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)
        os.utime(work / name, (OLD, OLD))
    if weight_bytes:
        with open(work / "resources/model/model.safetensors", "wb") as weights_file:
            weights_file.truncate(weight_bytes)  # sparse: its size is what the packing looks at
        os.utime(work / "resources/model/model.safetensors", (OLD, OLD))
    return work


@pytest.fixture
def packed(tmp_path):
    def pack(**model):
        out = tmp_path / "out"
        out.mkdir()
        done = device_resume("pack", finished_run(tmp_path / "device", **model), out, "shape")
        assert done.returncode == 0, done.stderr
        return out
    return pack


def test_round_trip_keeps_every_finished_file_and_its_time(packed, tmp_path):
    out = packed(weights="written", weight_bytes=1024)
    work = tmp_path / "next"
    done = device_resume("unpack", out, work, "shape")
    assert done.returncode == 0, done.stderr
    assert "goes on from reference workload" in done.stdout
    for name in ("results/reference/outputs.csv", "results/workload/prompts.jsonl", "resources/model/config.json",
                 "resources/model/model.safetensors", "logs/reference/reference.log"):
        assert (work / name).stat().st_mtime == OLD, name


def test_the_committed_tarball_leaves_out_prompts_and_model(packed):
    out = packed()
    listed = subprocess.run(["tar", "-tzf", str(out / "shape.tar.gz")], capture_output=True, text=True).stdout
    assert "results/reference/outputs.csv" in listed
    assert "prompts.jsonl" not in listed and "resources" not in listed


def test_written_weights_too_large_to_come_back_are_refused_not_started_without(packed, tmp_path):
    out = packed(weights="written", weight_bytes=65 * 2**20)
    work = tmp_path / "next"
    done = device_resume("unpack", out, work, "shape")
    assert done.returncode == 2
    assert "too large to come back" in done.stderr and "shape" in done.stderr
    assert list(work.iterdir()) == [] and sorted(path.name for path in tmp_path.iterdir()) == ["device", "next", "out"]


def test_unpack_never_overwrites_results_already_there(packed, tmp_path):
    out = packed()
    work = tmp_path / "next"
    (work / "results").mkdir(parents=True)
    (work / "results" / "table1.md").write_text("measured here")
    done = device_resume("unpack", out, work, "shape")
    assert done.returncode == 2 and "already holds results" in done.stderr
    assert (work / "results" / "table1.md").read_text() == "measured here"
    assert not (work / "results" / "reference").exists()


def test_a_missing_tarball_is_named(tmp_path):
    done = device_resume("unpack", tmp_path, tmp_path / "next", "shape")
    assert done.returncode == 2 and f"{tmp_path}/shape.tar.gz" in done.stderr


def test_a_run_whose_second_tarball_did_not_come_back_leaves_nothing_unpacked(packed, tmp_path):
    out = packed()
    (out / "shape.resume.tar.gz").unlink()
    work = tmp_path / "next"
    done = device_resume("unpack", out, work, "shape")
    assert done.returncode == 2 and "shape.resume.tar.gz" in done.stderr
    assert list(work.iterdir()) == [] and not list(tmp_path.glob("next.unpacking.*"))
