"""Stand-in replicas and pool servers (fake_replica.py, fake_engine.py), the plans that start them, and
the driver scripts that run a fleet in a process of their own, so a test can signal it."""

import sys
from pathlib import Path

import psutil

from kvpool.engine.plan_types import Plan, ReplicaPlan, ServerPlan
from kvpool.engine.ports import free_ports

HERE = Path(__file__).resolve().parent
FAKE = str(HERE / "fake_replica.py")
FAKE_ENGINE = str(HERE / "fake_engine.py")
TEST_PORTS = 38100  # away from the pipeline's own range, so a test never takes a real replica's port


def fake_plan(mode: str, count: int = 2, ports=None, source="auto") -> Plan:
    ports = ports or free_ports("127.0.0.1", count, start=TEST_PORTS)
    return Plan(cell="test", engine_kind="vllm-cpu", model="fake", port_source=source, replicas=tuple(
        ReplicaPlan(index=i, host="127.0.0.1", port=p, core=None, gpu=None, sequential_start=False, pool_dir=None,
                    lmcache_config_file=None, lmcache_config=None, env={},
                    argv=[sys.executable, FAKE, mode, "--port", str(p)])
        for i, p in enumerate(ports)))


def fake_server_plan(mode, count=1) -> Plan:
    ports = free_ports("127.0.0.1", 2 * count, start=TEST_PORTS + 200)
    return Plan(cell="test", engine_kind="vllm-cpu", model="fake", port_source="auto", replicas=(), servers=tuple(
        ServerPlan(index=i, kind="lmcache", host="127.0.0.1", port=ports[2 * i], http_port=ports[2 * i + 1], env={},
                   argv=[sys.executable, FAKE, mode, "--port", str(ports[2 * i]), "--http-port", str(ports[2 * i + 1])])
        for i in range(count)))


def write_driver(tmp_path, *body: str) -> Path:
    """A Python script that runs ``body`` (lines) with Ctrl-C raising KeyboardInterrupt and tests/ importable
    (``from support.fakes import fake_plan``).

    A shell's background job starts with SIGINT ignored, and Python keeps it so; the Ctrl-C path is
    what is under test, so the driver restores Python's default handler.
    """
    driver = tmp_path / "driver.py"
    driver.write_text("\n".join(["import signal, sys, time",
                                   "signal.signal(signal.SIGINT, signal.default_int_handler)",
                                   f"sys.path.insert(0, {str(HERE.parent)!r})", *body]) + "\n")
    return driver


def family(pid):
    try:
        proc = psutil.Process(pid)
        return [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
