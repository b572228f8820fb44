"""bench/device_resume.sh: a run carried from one lent machine to the next keeps its finished steps' files and
times, leaves out what cannot come back, and refuses to unpack where it would overwrite or could not go on."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import pytest
from support import REPO, as_in_a_terminal

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
        ".snakemake/log/run.snakemake.log": "Finished job 0.\n",
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
    done = device_resume("unpack", tmp_path / "docs" / "shape", tmp_path / "next", "shape")
    assert done.returncode == 2 and f"{tmp_path}/docs/shape is not a folder" in done.stderr


def test_a_run_whose_second_tarball_did_not_come_back_leaves_nothing_unpacked(packed, tmp_path):
    out = packed()
    (out / "shape.resume.tar.gz").unlink()
    work = tmp_path / "next"
    done = device_resume("unpack", out, work, "shape")
    assert done.returncode == 2 and "shape.resume.tar.gz" in done.stderr
    assert list(work.iterdir()) == [] and not list(tmp_path.glob("next.unpacking.*"))


# A checkout's clock: a committed run's files get the time git wrote them, never the machine's.
CHECKOUT = 1_800_000_000
REBUILT = {"results/workload/prompts.jsonl": '{"id": 0}\n', "resources/model/config.json": "{}",
           "resources/model/kvpool-model.json": json.dumps({"weights": "drawn"}, indent=2)}
# What a REBUILD command gets: --directory and the targets; it writes what the workflow's rules would.
REBUILD_SCRIPT = """
import json, pathlib, sys
args = sys.argv[2:]
directory = pathlib.Path(args[args.index("--directory") + 1])
targets = args[args.index("--directory") + 2:]
for name, text in json.loads(sys.argv[1]).items():
    if name in targets or name.split("/")[0] + "/" + name.split("/")[1] in targets:
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text)
print("built", *targets)
"""


def rebuild(files=REBUILT):
    return [sys.executable, "-c", REBUILD_SCRIPT, json.dumps(files)]


@pytest.fixture
def committed(packed, tmp_path):
    """The committed tarball as a session commits it (docs/results/<name>/): unpacked, Snakemake's own log under
    snakemake-log/, every file at the checkout's time."""
    def commit(**model):
        out = packed(**model)
        folder = tmp_path / "committed" / "shape"
        folder.mkdir(parents=True)
        with tarfile.open(out / "shape.tar.gz") as tar:
            tar.extractall(folder, filter="data")
        (folder / ".snakemake" / "log").rename(folder / "snakemake-log")
        (folder / ".snakemake").rmdir()
        for path in folder.rglob("*"):
            os.utime(path, (CHECKOUT, CHECKOUT))
        return folder
    return commit


def test_pack_records_every_files_time_and_the_digests_of_what_it_leaves_out_of_the_committed_tarball(packed):
    out = packed()
    with tarfile.open(out / "shape.tar.gz") as tar:
        times = tar.extractfile("resume/times.tsv").read().decode()
        sums = tar.extractfile("resume/SHA256SUMS").read().decode()
    recorded = dict(reversed(line.split("\t")) for line in times.splitlines())
    assert set(recorded) == {"results/reference/outputs.csv", "results/workload/prompts.jsonl",
                             "resources/model/config.json", "resources/model/kvpool-model.json",
                             "logs/reference/reference.log", ".snakemake/log/run.snakemake.log"}
    assert all(float(time) == OLD for time in recorded.values())
    digested = {line[66:]: line[:64] for line in sums.splitlines()}
    assert digested == {name: hashlib.sha256(text.encode()).hexdigest() for name, text in REBUILT.items()}


def test_a_committed_run_goes_on_with_its_prompts_and_model_rebuilt_and_every_file_at_its_own_time(
        committed, tmp_path):
    folder = committed()
    work = tmp_path / "next"
    done = device_resume("unpack", folder, work, "shape", *rebuild())
    assert done.returncode == 0, done.stderr
    assert "goes on from reference workload" in done.stdout
    for name in ("results/reference/outputs.csv", "logs/reference/reference.log", ".snakemake/log/run.snakemake.log",
                 *REBUILT):
        assert (work / name).stat().st_mtime == OLD, name
    assert (work / ".snakemake" / "log" / "run.snakemake.log").read_text() == "Finished job 0.\n"
    assert not (work / "snakemake-log").exists() and not list(tmp_path.glob("next.unpacking*"))


def test_a_rebuilt_file_unlike_the_measured_one_stops_the_resume_by_name(committed, tmp_path):
    folder = committed()
    work = tmp_path / "next"
    done = device_resume("unpack", folder, work, "shape", *rebuild({**REBUILT, "resources/model/config.json": "{ }"}))
    assert done.returncode == 2
    assert "resources/model/config.json: FAILED" in done.stderr and "prompts.jsonl" not in done.stderr
    assert list(work.iterdir()) == [] and not list(tmp_path.glob("next.unpacking*"))


def test_a_model_config_written_by_other_transformers_is_named_as_the_cause(committed, tmp_path):
    """A model's config.json records the transformers version that wrote it: a resume on a machine with another
    version fails its digest, and the refusal says which version rebuilt it (measured: 5.19.0 here, 5.17.0 on the
    device tool's machine)."""
    other = {**REBUILT, "resources/model/config.json": '{"transformers_version": "9.9.9"}'}
    done = device_resume("unpack", committed(), tmp_path / "next", "shape", *rebuild(other))
    assert done.returncode == 2
    assert "config.json: FAILED (rebuilt by transformers 9.9.9 here" in done.stderr


def test_a_committed_run_without_a_rebuild_command_names_what_it_would_rebuild(committed, tmp_path):
    done = device_resume("unpack", committed(), tmp_path / "next", "shape")
    assert done.returncode == 2
    assert "needs a command to rebuild" in done.stderr and "results/workload/prompts.jsonl" in done.stderr


def test_a_committed_run_missing_a_file_it_had_is_refused_by_name(committed, tmp_path):
    folder = committed()
    (folder / "logs" / "reference" / "reference.log").unlink()
    done = device_resume("unpack", folder, tmp_path / "next", "shape", *rebuild())
    assert done.returncode == 2 and "lacks logs/reference/reference.log" in done.stderr
    assert list((tmp_path / "next").iterdir()) == []


def test_written_weights_small_enough_to_digest_go_on_when_rebuilt_alike_and_stop_when_not(committed, tmp_path):
    """The model's weights written on the last machine, 1 KiB: their digest came back, so weights built again here
    are held to it."""
    folder = committed(weights="written", weight_bytes=1024)
    alike = {**REBUILT, "resources/model/kvpool-model.json": json.dumps({"weights": "written"}, indent=2),
             "resources/model/model.safetensors": "\0" * 1024}
    done = device_resume("unpack", folder, tmp_path / "unlike", "shape",
                         *rebuild({**alike, "resources/model/model.safetensors": "\1" * 1024}))
    assert done.returncode == 2 and "resources/model/model.safetensors: FAILED" in done.stderr
    done = device_resume("unpack", folder, tmp_path / "next", "shape", *rebuild(alike))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "next" / "resources/model/model.safetensors").stat().st_mtime == OLD


def test_written_weights_too_large_to_digest_are_refused_when_built_again(committed, tmp_path):
    folder = committed(weights="written", weight_bytes=65 * 2**20)
    weights = {**REBUILT, "resources/model/model.safetensors": "weights drawn again"}
    done = device_resume("unpack", folder, tmp_path / "next", "shape", *rebuild(weights))
    assert done.returncode == 2
    assert "no digest of resources/model/model.safetensors" in done.stderr and ".device-resume" in done.stderr
    assert list((tmp_path / "next").iterdir()) == [] and not list(tmp_path.glob("next.unpacking*"))


def test_a_committed_run_packed_without_resume_records_is_refused_by_name(tmp_path):
    """docs/results/h100-shape-a-99k, say: packed before pack wrote resume/, so nothing says its files' times."""
    folder = tmp_path / "h100-shape-a-99k"
    (folder / "results").mkdir(parents=True)
    (folder / "results" / "table1.md").write_text("measured")
    done = device_resume("unpack", folder, tmp_path / "next", "h100-shape-a-99k", *rebuild())
    assert done.returncode == 2
    assert "without resume/times.tsv" in done.stderr and "run it afresh" in done.stderr
    assert list((tmp_path / "next").iterdir()) == []


def test_a_failed_or_interrupted_rebuild_leaves_nothing_beside_the_working_directory(committed, tmp_path):
    folder = committed()
    failed = device_resume("unpack", folder, tmp_path / "next", "shape", sys.executable, "-c",
                           "import sys; print('no model here'); sys.exit(3)")
    assert failed.returncode == 2 and "rebuilding" in failed.stderr and "no model here" in failed.stderr
    # Ctrl-C while the rebuild runs: the whole process group gets SIGINT
    started = tmp_path / "rebuild-started"
    running = subprocess.Popen(["bash", SCRIPT, "unpack", str(folder), str(tmp_path / "next"), "shape",
                                sys.executable, "-c", f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); "
                                "time.sleep(30)"], start_new_session=True,
                               preexec_fn=as_in_a_terminal)
    deadline = time.monotonic() + 20
    while not started.exists() and time.monotonic() < deadline:  # a loaded machine: signal the rebuild, not the start
        time.sleep(0.1)
    assert started.exists()
    os.killpg(running.pid, signal.SIGINT)
    assert running.wait(timeout=20) == 130
    assert list((tmp_path / "next").iterdir()) == [] and not list(tmp_path.glob("next.unpacking*"))

