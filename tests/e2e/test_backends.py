"""The other pool backends on the real stack, each in a working directory of its own holding the session's
prerequisites: LMCache's redis:// against servers the pipeline starts, and the study's literal local_disk
setting, whose cell must come out invalid."""

import json
import subprocess
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
from support import CONFIGS
from support.e2e import CELL, copy_prerequisites, replicas_running_in, snakemake, snakemake_argv


def redis_servers_running_in(workdir):
    """The redis-server processes working under ``workdir`` (each cell's servers run in folders of its pool;
    a server rewrites its command line to its address, so the folder is what tells whose it is)."""
    found = []
    for process in psutil.process_iter(["name", "cmdline"]):
        try:
            if "redis-server" in " ".join(process.info["cmdline"] or [process.info["name"] or ""]) and \
                    Path(process.cwd()).resolve().is_relative_to(Path(workdir).resolve()):
                found.append(process.pid)
        except (psutil.Error, OSError):
            pass
    return found


@pytest.mark.full
def test_a_redis_pool_is_shared_and_its_bytes_are_counted_and_checked(tmp_path, prerequisites):
    """Both arms, two follow-ups a document: before each second one the serving replica's prefix cache is emptied,
    and in the isolated arm its Redis servers, which held the document the first follow-up recomputed. The model
    is the session's; the prompts and the reference are made anew for the second follow-ups."""
    prepared = copy_prerequisites(prerequisites, tmp_path, parts=("resources", "results/launch-check.json"))
    overlay = prepared / "two-followups.yaml"
    overlay.write_text("workload:\n  followups_per_document: 2\n")
    result = snakemake(prepared, CONFIGS / "e2e.yaml", CONFIGS / "e2e-redis.yaml", overlay)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    cell = "results/cells/backend~lmcache-redis/arm~{arm}/chunk~256/tier~ram"
    shared, isolated = (prepared / cell.format(arm=arm) for arm in ("shared", "isolated"))
    for folder in (shared, isolated):
        validity = json.loads((folder / "validity.json").read_text())
        assert validity["valid"] and validity["checks"]["own_cache_unused"]["ok"], validity["checks"]
    # every follow-up loads its whole document from the shared server, none from an isolated one
    shared_rows, isolated_rows = pd.read_csv(shared / "reuse.csv"), pd.read_csv(isolated / "reuse.csv")
    assert len(shared_rows) == len(isolated_rows) == 8 and set(isolated_rows["followup"]) == {0, 1}
    assert (shared_rows["external_hit_tokens"] == 2048).all()
    assert (isolated_rows["external_hit_tokens"] == 0).all()
    # the isolated servers held the recomputed document before each second follow-up, and nothing after
    clears = json.loads((isolated / "reuse.json").read_text())["clears_between_reloads"]
    assert len(clears) == 4 and all(len(clear["servers"]) == 2 for clear in clears)
    assert all(sum(server["bytes_before"] for server in clear["servers"]) >= 2048 * 4096 for clear in clears)
    assert all(server["bytes_after"] == 0 for clear in clears for server in clear["servers"])
    assert "clears_between_reloads" not in json.loads((shared / "reuse.json").read_text())
    # the emptied servers were read back before each emptying: populate's chunks are still checked unchanged
    for folder in (shared, isolated):
        assert json.loads((folder / "validity.json").read_text())["checks"]["pool_unchanged"]["ok"]
    # the pool's size is what the server holds: one value per chunk of KV (4 KiB a token)
    populate = json.loads((shared / "populate.json").read_text())
    (server,) = populate["pool_server"].values()
    chunks, kv = server["metrics"]["redis_pool_chunks"], server["metrics"]["redis_pool_kv_bytes"]
    assert kv == chunks * 256 * 4096 and populate["pool"]["bytes"] == kv >= 4 * 2048 * 4096
    assert populate["pool"]["source"].startswith("redis_pool_kv_bytes")
    digests = pd.read_csv(shared / "populate-digests.csv")
    assert len(digests) == chunks and set(digests["copy"]) == {"shared"}
    # the arms' stored chunks, read back from their servers, agree bit for bit
    kv_bytes = pd.read_csv(prepared / "results" / "kv_bytes.csv")
    rows = kv_bytes[kv_bytes["backend"] == "lmcache-redis"].set_index("comparison")
    assert rows.loc["store_across_arms", "keys"] >= 32 and rows.loc["store_across_arms", "differ"] == 0
    assert rows.loc["after_load_against_cold", "keys"] > 0 and rows.loc["after_load_against_cold", "differ"] == 0
    assert "lmcache-redis" in (prepared / "results" / "report.html").read_text()
    assert redis_servers_running_in(prepared) == [] and replicas_running_in(prepared) == []


def test_local_disk_shared_arm_is_marked_invalid(prepared):
    result = snakemake(prepared, CONFIGS / "e2e.yaml", CONFIGS / "e2e-local-disk.yaml")
    assert result.returncode != 0
    assert "failed the validity gate" in result.stdout + result.stderr
    cell = prepared / CELL.format(backend="lmcache-local-disk", arm="shared")
    record = json.loads((cell / "validity.json").read_text())
    assert not record["valid"]
    assert not record["checks"]["pool_hits"]["ok"] and record["checks"]["pool_hits"]["value"] == 0
    assert not record["checks"]["preflight"]["ok"]
    assert (pd.read_csv(cell / "reuse.csv")["external_hit_tokens"] == 0).all()  # the data is kept
    # The gate fails last: the tables and the page that explain the failure were rebuilt first.
    table1 = pd.read_csv(prepared / "results" / "table1.csv")
    assert "lmcache-local-disk" in set(table1["backend"])
    html = (prepared / "results" / "report.html").read_text()
    assert "lmcache-local-disk" in html and "INVALID" in html
    assert replicas_running_in(prepared) == []


@pytest.mark.full
def test_a_redis_server_killed_during_reuse_leaves_an_invalid_cell_and_populates_records(prepared, tmp_path):
    """kill -9 of the shared Redis server once the reuse fleet is up: the job ends instead of crashing (which
    would take populate's outputs with it, populate and reuse being one job around the servers), the cell
    is INVALID with the server's death named, and no server or replica is left."""
    shared_only = tmp_path / "shared-only.yaml"
    shared_only.write_text("arms: [shared]\n")
    target = "results/cells/backend~lmcache-redis/arm~shared/chunk~256/tier~ram"
    run = subprocess.Popen(snakemake_argv(prepared, f"{target}/validity.json", CONFIGS / "e2e.yaml",
                                          CONFIGS / "e2e-redis.yaml", shared_only),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = prepared / "logs" / "cell" / (target.removeprefix("results/cells/") + ".log")
    deadline = time.monotonic() + 900
    while not (log.exists() and "after the drop" in log.read_text()):  # the cell's one fleet, into its reuse
        assert run.poll() is None and time.monotonic() < deadline, "the reuse fleet never came up"
        time.sleep(0.2)
    (server,) = redis_servers_running_in(prepared)
    psutil.Process(server).kill()
    output = run.communicate(timeout=1800)[0]
    assert run.returncode == 0, output[-4000:]
    cell = prepared / target
    assert len(pd.read_csv(cell / "populate.csv")) == 4 and (cell / "reuse.csv").exists()
    validity = json.loads((cell / "validity.json").read_text())
    assert not validity["valid"]
    servers = validity["checks"]["pool_servers"]
    assert servers["ok"] is False and any("redis server" in example for example in servers["examples"])
    assert redis_servers_running_in(prepared) == [] and replicas_running_in(prepared) == []
