"""The lmcache-mp backend without a GPU: its plan, its refusals, its server's lifecycle and metrics."""

import dataclasses
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import psutil
import pytest
from support import REPO
from support.fakes import FAKE, FAKE_ENGINE, fake_server_plan, family, write_driver

from kvpool import config as kvpool_config
from kvpool import settings as kvpool_settings
from kvpool.cells import Cell
from kvpool.engine import mp
from kvpool.engine.errors import FleetError
from kvpool.engine.fleet import running_servers
from kvpool.engine.model import vocabulary
from kvpool.engine.plan import fleet_plan, server_port_count, with_server_ports
from kvpool.engine.plan_types import write_plan
from kvpool.engine.ports import free_ports, resolve_server_ports
from kvpool.matrix import cells
from kvpool.measure import kvbytes, timed, unit_plan
from kvpool.studies import load, study_a

TEST_PORTS = 38300


@pytest.fixture
def gpu_config(config):
    """The default config moved to the GPU engine and the MP backend (a plan needs no GPU)."""
    config["engine"].update(kind="vllm", gpus=[0], replicas_per_gpu=2, gpu_memory_utilization=0.8)
    config["backends"] = ["lmcache-mp"]
    config["tiers"] = {"ram": "/dev/shm/kvpool", "disk": "pools/disk"}
    config["lmcache_mp"] = {"memory_tiers": ["ram"], "l1_size_gib": None, "l1_fill": 0.7, "eviction_policy": "LRU",
                            "l2_use_odirect": False, "extra_args": [], "env": {}, "startup_timeout_s": 60,
                            "drain_timeout_s": 30, "release_timeout_s": 5, "gpu_workers": [None], "servers": ["one"]}
    return config


def mp_plan(config, arm, tier, server_ports=(20001, 20002, 20003, 20004)):
    count = 1 if arm == "shared" else 2
    return fleet_plan(config, Cell("lmcache-mp", arm, 256, tier), "/models/m", Path("/tmp/cell"), [18100, 18101],
                      "config", server_ports=list(server_ports[:2 * count]))


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_shared_arm_has_one_server_for_every_replica(gpu_config):
    plan = mp_plan(gpu_config, "shared", "ram")
    (server,) = plan.servers
    assert plan.memory_pool is True
    assert flag(server.argv, "--host") == flag(server.argv, "--http-host") == "127.0.0.1"
    assert (flag(server.argv, "--port"), flag(server.argv, "--http-port")) == ("20001", "20002")
    assert "--l2-adapter" not in server.argv and server.l2_dir is None
    for replica in plan.replicas:
        transfer = json.loads(flag(replica.argv, "--kv-transfer-config"))
        assert transfer == {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 20001}}
        assert replica.server == 0 and "LMCACHE_CONFIG_FILE" not in replica.env


def test_isolated_arm_has_a_server_per_replica_and_nothing_else_differs(gpu_config):
    shared, isolated = mp_plan(gpu_config, "shared", "disk"), mp_plan(gpu_config, "isolated", "disk")
    assert len(isolated.servers) == 2 and isolated.memory_pool is False
    ports = [json.loads(flag(r.argv, "--kv-transfer-config"))["kv_connector_extra_config"]["lmcache.mp.port"]
             for r in isolated.replicas]
    assert ports == [20001, 20003]
    # the server command differs between arms only in its ports and its L2 folder
    def strip(argv):
        return [a for a in argv if not a.isdigit() and "base_path" not in a]

    for server in isolated.servers:
        assert strip(server.argv) == strip(shared.servers[0].argv)
    l2 = [json.loads(flag(s.argv, "--l2-adapter")) for s in isolated.servers]
    assert [a["base_path"] for a in l2] == [r.pool_dir for r in isolated.replicas]
    assert all(a == {"type": "fs", "base_path": a["base_path"], "use_odirect": False} for a in l2)
    assert shared.servers[0].l2_dir == shared.replicas[0].pool_dir == shared.replicas[1].pool_dir
    # the replicas' own arguments are those of the shared arm but for the connector's port
    for r_shared, r_isolated in zip(shared.replicas, isolated.replicas, strict=True):
        assert [a for a in r_shared.argv if "LMCacheMPConnector" not in a] == \
               [a for a in r_isolated.argv if "LMCacheMPConnector" not in a]


def test_gpu_workers_is_a_dimension_of_the_mp_cells_alone(gpu_config):
    gpu_config["backends"] = ["lmcache-mp", "lmcache-fs"]
    gpu_config["lmcache_mp"]["gpu_workers"] = [None, 2]
    found = cells(gpu_config)
    mp_cells = [cell for cell in found if cell.backend == "lmcache-mp"]
    assert len(mp_cells) == 2 * len([cell for cell in found if cell.backend == "lmcache-fs"])
    assert {cell.gpu_workers for cell in mp_cells} == {None, 2}
    assert {cell.gpu_workers for cell in found if cell.backend == "lmcache-fs"} == {None}
    two = Cell("lmcache-mp", "shared", 256, "ram", 2)
    # LMCache's default keeps the folder it always had; a set value is in it, and the name reads back
    assert Cell("lmcache-mp", "shared", 256, "ram").name == "backend~lmcache-mp/arm~shared/chunk~256/tier~ram"
    assert two.name == "backend~lmcache-mp+gpu_workers=2/arm~shared/chunk~256/tier~ram"
    assert Cell.from_name(two.name) == two and two.label == "lmcache-mp+gpu_workers=2"
    with pytest.raises(ValueError, match="lmcache-fs\\+gpu_workers=2.*not a backend"):
        Cell.from_name("backend~lmcache-fs+gpu_workers=2/arm~shared/chunk~256/tier~ram")


def test_the_server_gets_the_cells_gpu_workers_and_the_user_cannot_set_them(gpu_config):
    two = fleet_plan(gpu_config, Cell("lmcache-mp", "shared", 256, "ram", 2), "/models/m", Path("/tmp/cell"),
                     [18100, 18101], "config", server_ports=[20001, 20002])
    assert flag(two.servers[0].argv, "--max-gpu-workers") == "2"
    assert "--max-gpu-workers" not in mp_plan(gpu_config, "shared", "ram").servers[0].argv
    gpu_config["lmcache_mp"]["extra_args"] = ["--max-workers", "4"]
    found = kvpool_config.problems(gpu_config, Path("/tmp"), check_paths=False)
    assert any("lmcache_mp.extra_args sets --max-workers" in problem for problem in found)


def test_adding_a_gpu_workers_value_re_runs_no_measured_cell(gpu_config):
    """Each step is handed its sections less the dimension, so a cell's jobs see the same settings
    whatever the other cells are."""
    job = SimpleNamespace(backend="lmcache-mp", level="c32")
    before = {step: kvpool_settings.step_settings(step, gpu_config, job)
              for step in (study_a.make_plan, study_a.run_cell, load.run_load_level)}
    gpu_config["lmcache_mp"]["gpu_workers"] = [None, 2]
    for step, settings in before.items():
        assert kvpool_settings.step_settings(step, gpu_config, job) == settings
        assert "gpu_workers" not in settings.get("lmcache_mp", {})


def test_a_server_per_replica_is_a_dimension_of_the_shared_drive_tier_cells_alone(gpu_config):
    gpu_config["lmcache_mp"]["servers"] = ["one", "per-replica"]
    found = [cell for cell in cells(gpu_config)]
    several = [cell for cell in found if cell.servers == "per-replica"]
    # a RAM L1 is one server's, and the isolated arm has a server per replica already
    assert [(c.arm, c.tier) for c in several] == [("shared", "disk")]
    assert len(found) == 2 * 2 + 1  # (shared, isolated) x (ram, disk), and the shared disk pool once more
    (cell,) = several
    assert cell.name == "backend~lmcache-mp+servers=per-replica/arm~shared/chunk~256/tier~disk"
    assert Cell.from_name(cell.name) == cell and cell.server_per_replica
    both = Cell("lmcache-mp", "shared", 256, "disk", 2, "per-replica")
    assert both.label == "lmcache-mp+gpu_workers=2+servers=per-replica" and Cell.from_name(both.name) == both
    assert Cell.from_name(Cell("lmcache-mp", "shared", 256, "disk").name).servers == "one"
    with pytest.raises(ValueError, match="not a backend"):
        Cell.from_name("backend~lmcache-mp+servers=two/arm~shared/chunk~256/tier~disk")


def test_servers_per_replica_share_one_l2_folder_each_replica_on_its_own(gpu_config):
    cell = Cell("lmcache-mp", "shared", 256, "disk", servers="per-replica")
    assert server_port_count(cell, 2) == 4 and server_port_count(Cell("lmcache-mp", "shared", 256, "disk"), 2) == 2
    plan = fleet_plan(gpu_config, cell, "/models/m", Path("/tmp/cell"), [18100, 18101], "config",
                      server_ports=[20001, 20002, 20003, 20004])
    servers = plan.servers
    assert [s.port for s in servers] == [20001, 20003] and [s.http_port for s in servers] == [20002, 20004]
    # one L2 folder, the shared pool's, on both servers' command lines
    folders = {json.loads(flag(s.argv, "--l2-adapter"))["base_path"] for s in servers}
    assert folders == {servers[0].l2_dir} and servers[0].l2_dir.endswith("/shared")
    # each replica on its own server
    ports = [r.kv_transfer["kv_connector_extra_config"]["lmcache.mp.port"] for r in plan.replicas]
    assert ports == [20001, 20003] and [r.server for r in plan.replicas] == [0, 1]


def test_servers_per_replica_without_a_shared_drive_tier_is_refused(gpu_config):
    gpu_config["lmcache_mp"]["servers"] = ["per-replica"]
    assert not any("lmcache_mp.servers" in p for p in kvpool_config.problems(gpu_config, REPO, check_paths=False))
    gpu_config["tiers"] = {"ram": "/dev/shm/kvpool"}
    (refused,) = [p for p in kvpool_config.problems(gpu_config, REPO, check_paths=False) if "lmcache_mp.servers" in p]
    assert "drive tier" in refused and "RAM L1 is one server's" in refused


def test_adding_servers_per_replica_re_runs_no_measured_cell(gpu_config):
    job = SimpleNamespace(backend="lmcache-mp", level="c32")
    before = {step: kvpool_settings.step_settings(step, gpu_config, job)
              for step in (study_a.make_plan, study_a.run_cell, load.run_load_level)}
    gpu_config["lmcache_mp"]["servers"] = ["one", "per-replica"]
    for step, settings in before.items():
        assert kvpool_settings.step_settings(step, gpu_config, job) == settings


def test_l1_is_sized_for_the_whole_pool(gpu_config):
    workload, spec = gpu_config["workload"], gpu_config["random_model"]
    per_token = 2 * spec["layers"] * spec["kv_heads"] * spec["head_dim"] * 4  # float32 in the default config
    pool = workload["documents"] * (workload["doc_tokens"] + workload["followup_tokens"]) * per_token
    for tier in ("ram", "disk"):
        size = float(flag(mp_plan(gpu_config, "shared", tier).servers[0].argv, "--l1-size-gb"))
        assert pool / 0.7 / 2**30 <= size < pool / 0.7 / 2**30 + 0.1


def test_refusals_name_the_key_and_the_numbers(gpu_config):
    cpu = {**gpu_config, "engine": {**gpu_config["engine"], "kind": "vllm-cpu"}}
    assert any("lmcache-mp needs engine.kind vllm" in p for p in kvpool_config.problems(cpu, REPO, check_paths=False))
    small = {**gpu_config, "lmcache_mp": {**gpu_config["lmcache_mp"], "l1_size_gib": 0.02}}
    found = kvpool_config.problems(small, REPO, check_paths=False)
    ram = next(p for p in found if "tier ram" in p)
    assert "lmcache_mp.l1_size_gib 0.02 is too small" in ram and "the whole pool" in ram and "#5290" in ram
    disk = next(p for p in found if "tier disk" in p)
    assert "the largest request is 0.02 GiB" in disk
    # the drive tier needs room for one request only; the memory tier for the whole pool
    roomy = {**gpu_config, "lmcache_mp": {**gpu_config["lmcache_mp"], "l1_size_gib": 0.1}}
    found = kvpool_config.problems(roomy, REPO, check_paths=False)
    assert [p for p in found if "l1_size_gib" in p and "disk" in p] == []
    real = {**gpu_config, "engine": {**gpu_config["engine"], "model": "/models/m"}}
    assert any("l1_size_gib must be set" in p for p in kvpool_config.problems(real, REPO, check_paths=False))


def test_a_local_real_models_config_sizes_the_servers_l1(gpu_config, tmp_path):
    """A local model directory's config.json gives its KV bytes per token, so L1 is sized for its pool."""
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32,
                                                      "num_key_value_heads": 8, "hidden_size": 4096,
                                                      "torch_dtype": "bfloat16"}))
    gpu_config["engine"].update(model=str(tmp_path), dtype="auto")
    assert not [p for p in kvpool_config.problems(gpu_config, REPO, check_paths=False) if "l1_size_gib" in p]
    w = gpu_config["workload"]
    pool = w["documents"] * (w["doc_tokens"] + w["followup_tokens"]) * 131072  # 128 KiB of KV per token
    assert mp.l1_size_gib(gpu_config, "ram") == pytest.approx(pool / 0.7 / 2**30, abs=0.1)


def test_moving_a_server_rewires_its_replicas(gpu_config):
    plan = with_server_ports(mp_plan(gpu_config, "isolated", "disk"), 1, 21000, 21001)
    assert (flag(plan.servers[1].argv, "--port"), flag(plan.servers[1].argv, "--http-port")) == \
           ("21000", "21001")
    ports = [json.loads(flag(r.argv, "--kv-transfer-config"))["kv_connector_extra_config"]["lmcache.mp.port"]
             for r in plan.replicas]
    assert ports == [20001, 21000] and plan.replicas[1].kv_transfer["kv_connector_extra_config"][
        "lmcache.mp.port"] == 21000


def test_server_metrics_sum_labels_and_take_phase_deltas():
    text = textwrap.dedent("""\
        # TYPE lmcache_mp_l1_write_total counter
        lmcache_mp_l1_write_total{cache_salt=""} 10.0
        lmcache_mp_l1_write_total{cache_salt="x"} 2.0
        # TYPE lmcache_mp_l2_store_submitted_objects_chunks_total counter
        lmcache_mp_l2_store_submitted_objects_chunks_total 7.0
        # TYPE lmcache_mp_l2_store_completed_objects_chunks_total counter
        lmcache_mp_l2_store_completed_objects_chunks_total 5.0
        # TYPE lmcache_mp_l1_chunk_reuse_gap_seconds histogram
        lmcache_mp_l1_chunk_reuse_gap_seconds_bucket{le="1.0"} 3.0
        lmcache_mp_l1_chunk_reuse_gap_seconds_count 3.0
        # TYPE lmcache_mp_l1_memory_usage_bytes gauge
        lmcache_mp_l1_memory_usage_bytes{backend="dram"} 4096.0
        # TYPE process_cpu_seconds counter
        process_cpu_seconds_total 3.0
        """)
    found = mp.server_metrics(text)
    assert found == {"lmcache_mp_l1_write_total": 12.0, "lmcache_mp_l2_store_submitted_objects_chunks_total": 7.0,
                     "lmcache_mp_l2_store_completed_objects_chunks_total": 5.0,
                     "lmcache_mp_l1_memory_usage_bytes": 4096.0}
    assert mp.l2_pending(found) == 2
    delta = mp.metrics_delta(found, {"lmcache_mp_l1_write_total": 2.0, "lmcache_mp_l1_memory_usage_bytes": 10.0})
    assert delta["lmcache_mp_l1_write_total"] == 10.0 and delta["lmcache_mp_l1_memory_usage_bytes"] == 4096.0


def test_kv_bytes_says_a_memory_pool_has_nothing_to_hash():
    empty = kvbytes.read_digests(REPO / "tests" / "fixtures" / "empty-digests.csv")
    digests = {("lmcache-mp", 256, "ram", arm): empty for arm in ("shared", "isolated")}
    table = kvbytes.kv_bytes_table(digests, {"workload": {"doc_tokens": 1024}, "engine": {"kind": "vllm"}},
                                   {("lmcache-mp", 256, "ram"): "the pool is the server's L1"})
    assert list(table["comparison"]) == ["not applicable"]
    ((setting, _, found),) = kvbytes.findings(table)
    assert setting == ("lmcache-mp", 256, "ram") and found == "Not applicable: the pool is the server's L1"
    assert kvbytes.unexpected(table).empty


def test_servers_start_answer_and_leave_nothing_behind(tmp_path):
    with running_servers(fake_server_plan("serve", 2), tmp_path, timeout_s=30) as (plan, servers):
        pids = [p.pid for s in servers for p in family(s.proc.pid)]
        assert len(pids) == 4 and all(s.healthy() for s in servers)
        assert servers[0].metrics() == {"lmcache_mp_l1_write_total": 12.0, "lmcache_mp_l1_memory_usage_bytes": 4096.0}
        assert servers[0].drain(5) == {"pending_l2_stores": 0.0, "waited_s": pytest.approx(0, abs=1)}
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def test_mp_replicas_let_their_engine_unregister_before_it_exits(gpu_config):
    """vLLM kills its engine core at once by default, which can beat the connector's unregister and leave
    the server holding the replica's GPU memory: every MP replica gets a shutdown timeout, no other does."""
    for arm in ("shared", "isolated"):
        for replica in mp_plan(gpu_config, arm, "ram").replicas:
            assert flag(replica.argv, "--shutdown-timeout") == str(mp.REPLICA_SHUTDOWN_TIMEOUT_S)
    gpu_config["backends"] = ["lmcache-fs"]
    plan = fleet_plan(gpu_config, Cell("lmcache-fs", "shared", 256, "disk"), "/models/m", Path("/tmp/cell"),
                      [18100, 18101], "config")
    assert all("--shutdown-timeout" not in replica.argv for replica in plan.replicas)


def test_a_server_outliving_its_fleet_is_waited_for_until_it_lets_go_of_the_gpu_memory(gpu_config, tmp_path):
    """A memory pool's server keeps running after populate's fleet stops; the next fleet needs the GPU memory
    the server mapped from the stopped replicas. The wait is recorded; a server that keeps holding it stops
    the unit, naming the cause, before a fleet starts into an out-of-memory error (seen on the H200)."""
    with running_servers(fake_server_plan("releasing"), tmp_path, timeout_s=30) as (plan, servers):
        assert servers[0].registered() == [4298904369579032185]
        with timed.pool_servers(plan, tmp_path, gpu_config, servers) as (_, _, record):
            pass
        assert 1 <= record["0"]["released"]["waited_s"] < 5
        assert servers[0].registered() == []
    with running_servers(fake_server_plan("holding"), tmp_path, timeout_s=30) as (plan, servers):
        with pytest.raises(FleetError, match=r"lmcache server 0 still holds the GPU KV cache of 1 stopped "
                                             r"replica\(s\) after 2 s .*next fleet would run out"):
            with timed.pool_servers(plan, tmp_path, {**gpu_config, "lmcache_mp": {
                    **gpu_config["lmcache_mp"], "release_timeout_s": 2}}, servers):
                pass
    # servers the phase started itself stop with it: nothing to wait for
    with timed.pool_servers(fake_server_plan("holding"), tmp_path, gpu_config) as (_, _, record):
        pass
    assert "released" not in record["0"]


def test_a_crashed_server_is_an_error_with_its_log_tail(tmp_path):
    with pytest.raises(FleetError, match="(?s)lmcache server 0 .*exited with code 3.*CUDA out of memory"):
        with running_servers(fake_server_plan("die"), tmp_path, timeout_s=30):
            pass


def test_a_silent_server_times_out_and_is_stopped(tmp_path):
    plan = fake_server_plan("silent")
    with pytest.raises(FleetError, match="lmcache server 0 .*not healthy after 2 s"):
        with running_servers(plan, tmp_path, timeout_s=2):
            pass
    server = plan.servers[0]
    out = subprocess.run(["pgrep", "-f", f"{FAKE} silent --port {server.port} --http-port {server.http_port}"],
                         capture_output=True)
    assert out.stdout == b""


def test_a_failure_inside_stops_the_servers(tmp_path):
    with pytest.raises(RuntimeError, match="populate failed"):
        with running_servers(fake_server_plan("serve"), tmp_path, timeout_s=30) as (_, servers):
            pids = [p.pid for p in family(servers[0].proc.pid)]
            raise RuntimeError("populate failed")
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def test_a_taken_server_port_moves_before_start():
    import socket

    plan = fake_server_plan("serve")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", plan.servers[0].port))
        busy.listen()
        moved = resolve_server_ports(plan)
    assert moved.servers[0].port != plan.servers[0].port
    assert str(moved.servers[0].http_port) in moved.servers[0].argv


def test_running_servers_keep_their_ports_through_a_phase(tmp_path):
    """A memory pool's servers hold their own ports: a phase that re-checked them would find them
    taken, move them, and point the replicas at ports no server listens on (seen on the GPU)."""
    with running_servers(fake_server_plan("serve"), tmp_path, timeout_s=30) as (plan, servers):
        assert unit_plan.checked_ports(plan, servers) == plan
        moved = unit_plan.checked_ports(plan)  # a phase that starts its own servers moves taken ports
        assert moved.servers[0].port != plan.servers[0].port
        with pytest.raises(FleetError, match="running servers are"):
            with timed.pool_servers(moved, tmp_path, {"lmcache_mp": {}}, servers):
                pass


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_stop_the_servers(tmp_path, sig):
    driver = write_driver(tmp_path, "from support.fakes import fake_server_plan",
                          "from kvpool.engine.fleet import running_servers",
                          f"with running_servers(fake_server_plan('serve', 2), {str(tmp_path)!r}, 30):",
                          "    print('ready', flush=True)", "    time.sleep(600)")
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    members = psutil.Process(proc.pid).children(recursive=True)
    assert len(members) == 4
    proc.send_signal(sig)
    proc.wait(timeout=60)
    _, alive = psutil.wait_procs(members, timeout=10)
    assert not alive


def test_the_real_lmcache_server_starts_reports_and_stops(gpu_config, tmp_path):
    """LMCache's own server process (it runs on CPU; only the replicas' connector needs CUDA)."""
    gpu_config["workload"].update(documents=2, doc_tokens=1024)
    gpu_config["tiers"]["disk"] = str(tmp_path / "disk")
    plan = fleet_plan(gpu_config, Cell("lmcache-mp", "shared", 256, "disk"), "/models/m", tmp_path, [18100, 18101],
                      "auto", server_ports=free_ports("127.0.0.1", 2, start=TEST_PORTS + 50))
    with running_servers(plan, tmp_path / "logs", timeout_s=180) as (plan, servers):
        (server,) = servers
        found = server.metrics()
        assert found[mp.L1_BYTES] == 0 and server.drain(10)["pending_l2_stores"] == 0
        # emptied between an isolated arm's reloads of a document through its HTTP API, its L1 read back
        assert server.clear() == {"server": "lmcache server 0", "bytes_before": 0.0, "bytes_after": 0.0}
        pids = [p.pid for p in family(server.proc.pid)]
    log = (tmp_path / "logs" / "lmcache-server-0.log").read_text()
    assert "LMCache zmq cache server is running on 127.0.0.1" in log and "Cache cleared via HTTP API" in log
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def test_the_mp_gpu_config_plans_one_job_per_memory_pool_cell_and_three_per_drive_cell():
    out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--configfile", "config/h200-mp.yaml",
                          "--directory", "/tmp/kvpool-dry-mp", "-s", str(REPO / "Snakefile")],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = dict(line.split() for line in out.stdout.split("Job stats:")[1].splitlines()[3:]
                if len(line.split()) == 2 and line.split()[1].isdigit())
    # ram cells: populate, drop and reuse on one fleet around one set of servers; disk cells: the three rules,
    # each phase's fleet and server its own (the reuse must find the server's L1 empty)
    assert (jobs["cell"], jobs["populate"], jobs["drop"], jobs["reuse"]) == ("2", "2", "2", "2")


@pytest.mark.parametrize("name", ["h200x2-mp-load", "h200-mp-load"])
def test_the_gpu_load_config_measures_its_memory_pool_cells_at_every_level(name, tmp_path):
    """A memory pool cannot be restored between levels; its levels populate fresh servers instead,
    so the MP ram cells get every level rather than c1 alone."""
    out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "all", "--configfile", f"config/{name}.yaml",
                          "--directory", str(tmp_path), "-s", str(REPO / "Snakefile")],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = dict(line.split() for line in out.stdout.split("Job stats:")[1].splitlines()[3:]
                if len(line.split()) == 2 and line.split()[1].isdigit())
    assert (jobs["cell"], jobs["load_level"], jobs["load_table"]) == ("2", "6", "1")


def test_the_readme_rerun_command_reruns_one_cell(tmp_path):
    """The README's own command re-runs one arm of one cell, and only that: `--forcerun` swallows any
    word after it, so a target placed there would force every cell's populate instead."""
    row = next(line for line in (REPO / "README.md").read_text().splitlines() if "re-run one arm of one cell" in line)
    command = row.split("`")[1].split()
    assert command[0] == "snakemake"  # as typed: the workflow profile gives the one core
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text((REPO / "config" / "config.yaml").read_text())
    out = subprocess.run([sys.executable, "-m", "snakemake", *command[1:], "-n", "--directory", str(tmp_path),
                          "-s", str(REPO / "Snakefile")], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = dict(line.split() for line in out.stdout.split("Job stats:")[1].splitlines()[3:]
                if len(line.split()) == 2 and line.split()[1].isdigit())
    # the cell's populate, drop and reuse on its one fleet: one job, then its gate
    assert jobs["cell"] == jobs["validity"] == "1" and "report" not in jobs


def test_a_server_that_dies_mid_phase_is_recorded_not_raised(gpu_config, tmp_path):
    """The phase's rows must survive a dead pool server: its record names the exit instead."""
    from kvpool.measure.timed import pool_servers

    with pool_servers(fake_server_plan("serve"), tmp_path, gpu_config) as (_, servers, record):
        servers[0].proc.kill()
        servers[0].proc.wait(timeout=10)
    assert "lmcache server 0" in record["0"]["error"] and "exited with code -9" in record["0"]["error"]
    assert record["0"]["metrics"] == {}


# Each arm and each tier once per commit; the two other pairs (a minute and a quarter of the fast lane's
# five on two cores) run in `make test-full`.
@pytest.mark.parametrize("arm, tier", [("isolated", "ram"), ("shared", "disk"),
                                       pytest.param("shared", "ram", marks=pytest.mark.full),
                                       pytest.param("isolated", "disk", marks=pytest.mark.full)])
def test_an_mp_cell_runs_its_phases_around_the_real_server(gpu_config, tmp_path, arm, tier):
    """An lmcache-mp cell rehearsed on CPU: LMCache's real server, stand-in engines for the replicas,
    whose connector needs a GPU. A memory pool runs populate, drop and reuse as one job around one
    set of servers, two follow-ups a document, an isolated arm's servers emptied before each second one;
    a drive tier starts a fresh server per phase on the same L2 folder. It catches
    what only the GPU had shown: running servers' ports re-checked, found taken (by themselves) and
    moved, leaving replicas to wait for a server that is not there."""
    from kvpool.engine import prompts
    from kvpool.engine.model import build_random_model

    model = tmp_path / "model"
    build_random_model(model, gpu_config["random_model"])
    gpu_config["workload"].update(documents=2, doc_tokens=512, followup_tokens=256,
                                  followups_per_document=2 if tier == "ram" else 1)
    gpu_config["tiers"] = {tier: str(tmp_path / tier)}
    gpu_config["preflight_on_failure"] = "record"
    cell = Cell("lmcache-mp", arm, 256, tier)
    folder = tmp_path / "cell"
    folder.mkdir()
    ports = free_ports("127.0.0.1", 6 if arm == "isolated" else 4, start=TEST_PORTS + 100)
    plan = fleet_plan(gpu_config, cell, str(model), folder, ports[:2], "auto", server_ports=ports[2:])
    plan = plan.with_replicas(
        dataclasses.replace(replica, argv=[sys.executable, FAKE_ENGINE, "--port", str(replica.port)])
        for replica in plan.replicas)
    write_plan(plan, folder / "plan.yaml")
    w = gpu_config["workload"]
    prompts.write_workload(tmp_path / "prompts.jsonl", prompts.make_workload(
        vocabulary(str(model)), w["documents"], w["doc_tokens"], w["followup_tokens"], w["seed"],
        w["followups_per_document"]))
    out = {name: str(folder / name) for name in ("populate.csv", "populate.json", "drop.json", "reuse.csv",
                                                 "reuse.json", "populate-digests.csv", "pool-digests.csv")}
    for phase in ("populate", "reuse"):
        for kind in ("drive", "power"):
            out[f"{phase}-{kind}"] = str(folder / f"{phase}-{kind}.csv")
    populate = {"csv": out["populate.csv"], "meta": out["populate.json"], "drive": out["populate-drive"],
                "power": out["populate-power"], "digests": out["populate-digests.csv"]}
    reuse = {"csv": out["reuse.csv"], "meta": out["reuse.json"], "drive": out["reuse-drive"],
             "power": out["reuse-power"], "digests": out["pool-digests.csv"]}
    logs = {name: str(tmp_path / "logs" / name) for name in ("servers", "replicas", "populate", "reuse")}
    plan_path, prompts_path = str(folder / "plan.yaml"), str(tmp_path / "prompts.jsonl")
    if tier == "ram":  # only the sections the rule hands its script, as Snakemake would
        declared = {key: gpu_config[key] for key in kvpool_settings.MEMORY_POOL_CELL_SETTINGS}
        study_a.run_cell(declared, cell, plan_path, prompts_path, populate=populate, drop_out=out["drop.json"],
                         reuse=reuse, log_dirs=logs)
    else:  # the three rules: each phase starts (and stops) its own servers, whose logs sit with its replicas'
        study_a.run_populate(gpu_config, cell, plan_path=plan_path, prompts_path=prompts_path, csv_out=populate["csv"],
                             json_out=populate["meta"], drive_csv=populate["drive"], power_csv=populate["power"],
                             digests_csv=populate["digests"], log_dir=logs["populate"])
        study_a.run_drop(gpu_config, plan_path, out["drop.json"])
        study_a.run_reuse(gpu_config, cell, plan_path=plan_path, prompts_path=prompts_path,
                          populate_csv=out["populate.csv"], populate_digests=populate["digests"], csv_out=reuse["csv"],
                          json_out=reuse["meta"], drive_csv=reuse["drive"], power_csv=reuse["power"],
                          digests_csv=reuse["digests"], log_dir=logs["reuse"])
    # a load level: a disk cell's restores the L2 folder and starts fresh servers on it, as reuse does;
    # a memory pool's starts fresh servers and populates them again
    level = {name: str(folder / "load~c2" / name) for name in ("requests.csv", "level.json", "drive.csv", "power.csv")}
    Path(level["level.json"]).parent.mkdir()
    load.run_load_level(gpu_config, cell, "c2", plan_path=plan_path, prompts_path=prompts_path,
                        populate_csv=out["populate.csv"], populate_digests=populate["digests"],
                        csv_out=level["requests.csv"], json_out=level["level.json"], drive_csv=level["drive.csv"],
                        power_csv=level["power.csv"], log_dir=str(tmp_path / "logs" / "c2"), remove_pool=True)
    level_meta = json.loads(Path(level["level.json"]).read_text())
    assert len(pd.read_csv(level["requests.csv"])) == 2
    restore = level_meta["pool_restore"]
    if tier == "ram":  # stand-in engines store nothing: a shared preflight fails; the rest must hold
        assert restore["repopulated"] and restore["same_placement"] and restore["errors"] == 0
        assert restore["bytes"] == restore["cell_bytes"] and restore["preflight_ok"] == (arm == "isolated")
    else:
        assert level_meta["checks"]["pool_restored"]["ok"] and restore["removed_files"] == 0
    assert set(level_meta["pool_server"]) == ({"0"} if arm == "shared" else {"0", "1"})
    assert all("error" not in server for server in level_meta["pool_server"].values())
    assert (folder / "load~c2" / "populate.csv").exists() == (tier == "ram")
    populated, reused = pd.read_csv(out["populate.csv"]), pd.read_csv(out["reuse.csv"])
    assert len(populated) == 2 and len(reused) == (4 if tier == "ram" else 2) and (reused["error"].isna()).all()
    assert (reused["prefill_replica"] != reused["serve_replica"]).all()
    clears = json.loads(Path(out["reuse.json"]).read_text()).get("clears_between_reloads", [])
    if arm == "isolated" and tier == "ram":  # before each document's second follow-up, every server of the arm
        assert len(clears) == 2 and all(clear["stores_settled"]["settled"] for clear in clears)
        assert [[server["server"] for server in clear["servers"]] for clear in clears] == \
            [["lmcache server 0", "lmcache server 1"]] * 2
        assert all(server["bytes_after"] == 0 for clear in clears for server in clear["servers"])
    else:
        assert clears == []
    meta = json.loads(Path(out["populate.json"]).read_text())
    assert len(meta["pool_server"]) == (1 if arm == "shared" else 2)  # each server's counters, read after the phase
    assert json.loads(Path(out["drop.json"]).read_text())["memory_backed"] == (tier == "ram")
    servers = sorted((tmp_path / "logs").rglob("lmcache-server-*.log"))
    # a fresh server for the load level, and for a disk cell's reuse
    assert len(servers) == len(meta["pool_server"]) * (2 if tier == "ram" else 3)
    assert all("LMCache zmq cache server is running on 127.0.0.1" in log.read_text() for log in servers)
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if FAKE_ENGINE in " ".join(p.info["cmdline"] or [])
                 or ("lmcache" in " ".join(p.info["cmdline"] or [])
                     and any(str(port) in (p.info["cmdline"] or []) for port in ports[2:]))]
    assert not leftovers
