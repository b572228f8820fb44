import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from support import REPO
from support.fakes import FAKE, TEST_PORTS, fake_plan, family, write_driver

from kvpool.engine.errors import FleetError
from kvpool.engine.fleet import running_fleet
from kvpool.engine.plan_types import write_plan
from kvpool.engine.ports import free_ports, resolve_ports
from kvpool.engine.processes import offload_regions


def test_fleet_starts_and_leaves_nothing_behind(tmp_path):
    with running_fleet(fake_plan("serve"), tmp_path, timeout_s=30) as replicas:
        pids = [p.pid for r in replicas for p in family(r.proc.pid)]
        assert len(pids) == 4  # two servers, each with a child
        assert all(r.healthy() for r in replicas)
    time.sleep(0.5)
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def test_a_replica_is_stopped_through_its_api_server(tmp_path):
    """vLLM's engine unregisters its GPU KV cache from an LMCache MP server only on an orderly shutdown;
    signalled directly, it leaves the server holding that GPU memory (seen on the H200)."""
    with running_fleet(fake_plan("orderly", count=1), tmp_path, timeout_s=30):
        pass
    assert "engine stopped by its API server" in (tmp_path / "replica-0.log").read_text()


def test_a_killed_replica_leaves_no_orphan(tmp_path):
    """kill -9 of a replica's API server: its engine (here one that left the process group) is still stopped."""
    with running_fleet(fake_plan("regroup", count=1), tmp_path, timeout_s=30) as (replica,):
        members = family(replica.proc.pid)
        assert len(members) == 2
        os.kill(replica.proc.pid, signal.SIGKILL)
        replica.proc.wait(timeout=10)
    _, alive = psutil.wait_procs(members, timeout=10)
    assert not alive


def test_a_job_killed_with_sigkill_leaves_no_replica_or_pool_server_running(tmp_path):
    """SIGKILL runs no stop path, and the replicas and servers sit in process groups of their own, so a kill
    of the job's group misses them: each is sent SIGTERM by the kernel when the job dies, and a replica stops
    its engine itself, as vLLM's API server does (a pool server, LMCache's or Redis, has no child)."""
    ports = free_ports("127.0.0.1", 2, start=TEST_PORTS)
    driver = write_driver(tmp_path, "from support.fakes import fake_plan, fake_server_plan",
                          "from kvpool.engine.fleet import running_fleet, running_servers",
                          f"with running_servers(fake_server_plan('orderly'), {str(tmp_path)!r}, 30):",
                          f"    with running_fleet(fake_plan('orderly', ports={ports}), {str(tmp_path)!r}, 30):",
                          "        print('ready', flush=True)", "        time.sleep(600)")
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    members = psutil.Process(proc.pid).children(recursive=True)
    assert len(members) == 6  # a server and two replicas, each with a child
    proc.kill()
    proc.wait(timeout=10)
    _, alive = psutil.wait_procs(members, timeout=10)
    for member in alive:  # not to leave them running when the test fails
        member.kill()
    assert not alive, [member.cmdline() for member in alive]


def test_ctrl_c_while_the_fleet_stops_still_stops_every_replica(tmp_path):
    ports = free_ports("127.0.0.1", 2, start=TEST_PORTS)
    driver = write_driver(tmp_path, "from support.fakes import fake_plan",
                          "from kvpool.engine.fleet import running_fleet",
                          f"with running_fleet(fake_plan('slowstop', ports={ports}), {str(tmp_path)!r}, 30):",
                          "    print('ready', flush=True)", "    time.sleep(1)", "print('stopped', flush=True)")
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    members = psutil.Process(proc.pid).children(recursive=True)
    assert len(members) == 4
    time.sleep(2)  # the fleet is stopping: replica 0's API server takes 3 s
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) != 0  # the Ctrl-C still ends the run, after the stop
    assert "stopped" not in proc.stdout.read()
    _, alive = psutil.wait_procs(members, timeout=10)
    for left in alive:  # a failing run must not leave its replicas to the next test
        left.kill()
    assert not alive


def test_dead_replica_error_carries_its_log_tail(tmp_path):
    with pytest.raises(FleetError, match="(?s)replica 0 .*exited with code 3.*CUDA out of memory"):
        with running_fleet(fake_plan("die", count=1), tmp_path, timeout_s=30):
            pass


def test_silent_replica_times_out_and_is_stopped(tmp_path):
    plan = fake_plan("silent", count=1)
    with pytest.raises(FleetError, match="not healthy after 2 s"):
        with running_fleet(plan, tmp_path, timeout_s=2):
            pass
    out = subprocess.run(["pgrep", "-f", f"{FAKE} silent --port {plan.replicas[0].port}"], capture_output=True)
    assert out.stdout == b""


def test_configured_port_in_use_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(FleetError, match=f"replica 0 port {port}.*engine.ports"):
            resolve_ports(fake_plan("serve", count=1, ports=[port], source="config"))
        moved = resolve_ports(fake_plan("serve", count=1, ports=[port], source="auto"))
        assert moved.replicas[0].port != port


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_stop_the_fleet(tmp_path, sig):
    ports = free_ports("127.0.0.1", 2, start=TEST_PORTS)
    driver = write_driver(tmp_path, "from support.fakes import fake_plan",
                          "from kvpool.engine.fleet import running_fleet",
                          f"with running_fleet(fake_plan('serve', ports={ports}), {str(tmp_path)!r}, 30):",
                          "    print('ready', flush=True)", "    time.sleep(600)")
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    members = [p for p in psutil.Process(proc.pid).children(recursive=True)]
    assert len(members) == 4
    proc.send_signal(sig)
    proc.wait(timeout=60)
    gone, alive = psutil.wait_procs(members, timeout=10)
    assert not alive


def test_an_exited_but_unreaped_process_counts_as_stopped():
    """A stop must not wait out its grace period on a zombie (exited, its parent has not reaped it)."""
    from kvpool.engine.processes import _still_running

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    zombie = psutil.Process(child.pid)
    deadline = time.monotonic() + 30
    while zombie.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.05)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    started = time.monotonic()
    assert _still_running([zombie, psutil.Process(sleeper.pid)], 0.5) == [psutil.Process(sleeper.pid)]
    assert _still_running([zombie], 20) == [] and time.monotonic() - started < 5
    sleeper.kill()
    sleeper.wait()
    child.wait()


def one_measured_request(replica):
    """One request through the phases' own measured path, as a follow-up would be sent."""
    import asyncio

    import aiohttp

    from kvpool.measure.timed import measured_request

    async def request():
        async with aiohttp.ClientSession() as session:
            return await measured_request(session, replica, [1, 2, 3], 4, 5.0)

    return asyncio.run(request())


def test_a_replica_killed_mid_request_is_named_in_that_request(tmp_path):
    """The request in flight when its replica is killed names the exit too, not only a broken stream."""
    with running_fleet(fake_plan("diemid", count=1), tmp_path, timeout_s=30) as (replica,):
        result, counts = one_measured_request(replica)
    assert counts == {}
    # the stream broke (or ended early) and the replica is gone: the row says which and why
    assert "replica 0" in result.error and "exited with code -9" in result.error


def test_a_request_to_a_dead_replica_is_a_row_naming_its_exit(tmp_path):
    """The phase keeps going and keeps its rows: the failed request says which replica died and why."""
    from kvpool.engine.processes import Replica

    replica = Replica(fake_plan("die", count=1).replicas[0], tmp_path / "replica-0.log")
    replica.start()
    replica.proc.wait(timeout=30)
    result, counts = one_measured_request(replica)
    assert counts == {}
    assert "replica 0" in result.error and "exited with code 3" in result.error
    assert "CUDA out of memory" in result.error  # the log tail


def test_a_port_another_server_also_listens_on_is_named(tmp_path):
    """vLLM binds with SO_REUSEPORT: a second server that binds the same port (another run that planned
    it at the same moment) silently takes a share of the requests."""
    plan = fake_plan("serve", count=1)
    plan.replicas[0].argv.append("--reuse-port")  # as vLLM does
    port = plan.replicas[0].port
    with running_fleet(plan, tmp_path, timeout_s=30) as (replica,):
        assert replica.port_owner_problem() is None
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            other.bind(("127.0.0.1", port))
            other.listen()
            problem = replica.port_owner_problem()
    assert f"port {port} is also listened on by pid {os.getpid()}" in problem and "engine.ports" in problem


def test_a_busy_configured_port_leaves_the_pool_alone(config, tmp_path):
    """populate checks its ports before it clears the cell's old pool."""

    from kvpool.cells import Cell, pool_root
    from kvpool.studies.study_a import run_populate

    config["tiers"] = {"disk": str(tmp_path / "tier")}
    cell = Cell("lmcache-fs", "shared", 256, "disk")
    kept = pool_root(config, cell) / "shared" / "chunk.data"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"measured")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        plan = fake_plan("serve", count=1, ports=[busy.getsockname()[1]], source="config")
        write_plan(plan, tmp_path / "plan.yaml")
        with pytest.raises(FleetError, match="configured ports are in use"):
            run_populate(config, cell, plan_path=str(tmp_path / "plan.yaml"), prompts_path="prompts.jsonl",
                         csv_out="p.csv", json_out="p.json", drive_csv="d.csv", power_csv="w.csv",
                         digests_csv="pd.csv", log_dir=str(tmp_path / "logs"))
    assert kept.read_bytes() == b"measured"


def test_a_second_run_in_one_working_directory_is_refused(tmp_path):
    from kvpool.measure.runlock import RunLocked, acquire

    held = acquire(tmp_path)
    other = subprocess.run([sys.executable, "-c",
                            f"from kvpool.measure.runlock import acquire; acquire({str(tmp_path)!r})"],
                           capture_output=True, text=True)
    assert other.returncode != 0 and f"another kvpool run (pid {os.getpid()})" in other.stderr
    with pytest.raises(RunLocked):  # another open file description in this process conflicts too
        acquire(tmp_path)
    # Snakemake takes it before the first job: a second run stops at once, naming the first
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text((REPO / "config" / "config.yaml").read_text())
    second = subprocess.run([sys.executable, "-m", "snakemake", "results/workload/prompts.jsonl", "--cores", "1",
                             "--directory", str(tmp_path), "-s", str(REPO / "Snakefile")],
                            capture_output=True, text=True, timeout=300)
    assert second.returncode != 0 and f"another kvpool run (pid {os.getpid()})" in second.stderr + second.stdout
    assert not (tmp_path / "resources").exists()  # no job ran
    held.close()
    acquire(tmp_path).close()  # released with its holder


def test_a_replica_says_what_it_serves_its_model_length_and_its_lmcache_chunk_size(tmp_path):
    """The model length from the replica's own /v1/models, the chunk size from its LMCache's log lines."""
    with running_fleet(fake_plan("serve", count=1), tmp_path, timeout_s=30) as (replica,):
        replica.log_path.write_text("LMCache INFO: num_layer: 4, chunk_size: 256, num_kv_head: 1\n"
                                    "Creating LMCacheEngine with config: {'chunk_size': 256, 'local_cpu': False}\n")
        assert replica.served() == {"max_model_len": 4096, "chunk_sizes": [256]}
        replica.log_path.write_text("")  # no connector: no chunk size to hold against the plan
        assert replica.served() == {"max_model_len": 4096, "chunk_sizes": []}


def test_a_replica_s_chunk_size_is_read_from_its_own_start_of_a_log_that_an_earlier_start_wrote_to(tmp_path):
    """Logs append: an earlier unit of the same log path (another config's chunk size, or the same unit
    measured before) left its LMCache's chunk size there; the check reads this start's section alone."""
    earlier = ("=== kvpool starts replica 0 at 2026-12-06T10:00:00+00:00, attempt 0123456789ab ===\n"
               "Creating LMCacheEngine with config: {'chunk_size': 256, 'local_cpu': False}\n")
    (tmp_path / "replica-0.log").write_text(earlier)
    with running_fleet(fake_plan("serve", count=1), tmp_path, timeout_s=30) as (replica,):
        with open(replica.log_path, "a") as log:
            log.write("Creating LMCacheEngine with config: {'chunk_size': 512, 'local_cpu': False}\n")
        assert replica.served()["chunk_sizes"] == [512]
    text = (tmp_path / "replica-0.log").read_text()
    assert text.startswith(earlier) and text.count("=== kvpool starts replica 0 at ") == 2


def test_a_log_s_last_start_is_its_section_from_the_last_start_line():
    from kvpool.engine.processes import this_start

    first, second = "=== kvpool starts replica 0 at 1, attempt a ===\nchunk_size: 256\n", \
        "=== kvpool starts replica 0 at 2, attempt b ===\nchunk_size: 512\n"
    assert this_start("old line\n" + first + second) == second
    assert this_start("a log from before start lines\n") == "a log from before start lines\n"
    assert this_start("quoted: === kvpool starts x\n" + first) == first  # only at a line's start


def test_a_stopped_replica_s_offload_region_in_dev_shm_is_removed_and_no_other(tmp_path):
    """vLLM's offloading connector (vllm-fs) maps each replica's CPU tier from /dev/shm and a stopped engine core
    leaves it (16 GiB a replica on the H100): the fleet removes what its replicas mapped, nothing else."""
    other = Path("/dev/shm") / f"vllm_offload_{uuid.uuid4()}.mmap"
    other.write_bytes(b"")  # another run's region: not mapped by this fleet
    try:
        with running_fleet(fake_plan("offload"), tmp_path, timeout_s=30) as replicas:
            for replica in replicas:  # the fake engine maps its region just after it starts
                for _ in range(100):
                    if "fake engine mapped" in replica.log_text():
                        break
                    time.sleep(0.05)
            regions = offload_regions([p for r in replicas for p in family(r.proc.pid)])
            assert len(regions) == 2 and all(path.exists() for path in regions) and other not in regions
        assert not [path for path in regions if path.exists()] and other.exists()
    finally:
        other.unlink(missing_ok=True)


def test_a_stopped_replica_s_lmcache_sockets_are_found_from_its_log_and_no_other_engine_s(tmp_path):
    """LMCache's engine leaves its RPC sockets in /tmp (thousands after a day of runs here): the replica's
    log names its engine's, and only those go when it stops."""
    from kvpool.engine.processes import lmcache_sockets

    mine, other = "0fca8666-c252-4334-b988-26acf6b61c33", "685c06c7-cd31-43bb-ac5a-bd3854cd1223"
    files = [tmp_path / f"engine_{engine}_service_{service}" for engine in (mine, other)
             for service in ("lookup_lmcache_rpc_port_0", "offload_lmcache_rpc_port_100")]
    for path in files:
        path.write_text("")
    log = ("\x1b[32;20m[2026-12-04 00:27:56,960] LMCache INFO:\x1b[0m Transport connecting to rank 0 with socket path "
           f"{tmp_path}/engine_{mine}_service_lookup_lmcache_rpc_port_0 \x1b[3m(zmq_transport.py:53)\x1b[0m\n")
    assert lmcache_sockets(log) == sorted(files[:2])
    assert lmcache_sockets("no LMCache here") == []
