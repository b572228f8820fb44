"""Starting and stopping a fleet of vLLM replicas: own process groups, health waits, nothing left behind."""

from __future__ import annotations

import logging
import signal
import time
from contextlib import contextmanager
from pathlib import Path

from kvpool.engine.errors import FleetError
from kvpool.engine.plan_types import Plan
from kvpool.engine.ports import _server_ports, claimed, release_ports, resolve_ports, resolve_server_ports
from kvpool.engine.processes import (
    ExternalReplica,
    ManagedProcess,
    MPServer,
    PoolServer,
    RedisServer,
    Replica,
    log_tail,
)

log = logging.getLogger(__name__)


def wait_healthy(replicas: list[ManagedProcess], timeout_s: float) -> None:
    """Block until every replica (or server) is healthy; a dead or silent one raises with its log tail."""
    deadline = time.monotonic() + timeout_s
    pending = list(replicas)
    while pending:
        for replica in list(pending):
            if not replica.alive():
                raise replica.died_error()
            if replica.healthy():
                replica.remember_family()
                pending.remove(replica)
        if pending and time.monotonic() > deadline:
            worst = pending[0]
            if isinstance(worst, ExternalReplica):
                raise FleetError(f"after {timeout_s:.0f} s (fleet.wait_s): {worst.died_error()}")
            raise FleetError(f"{worst.name} ({worst.url}) not healthy after {timeout_s:.0f} s; "
                             f"last lines of {worst.log_path}:\n{log_tail(worst.log_path)}")
        if pending:
            time.sleep(1.0)


@contextmanager
def running_fleet(plan: Plan, log_dir: Path, timeout_s: float):
    """Start every replica of ``plan``, wait for health, yield them, and always stop them all. An
    external fleet's replicas are only waited for: kvpool starts and stops none of them."""
    if plan.external:
        replicas = [ExternalReplica(entry) for entry in plan.replicas]
        # a deployed fleet is up already: wait its own short while, not a launched replica's startup
        wait_healthy(replicas, plan.wait_s if plan.wait_s is not None else timeout_s)
        log.info("external fleet of %d healthy", len(replicas))
        yield replicas
        return
    plan, ports = claimed(plan, resolve_ports, lambda plan: [r.port for r in plan.replicas])
    replicas = [Replica(entry, Path(log_dir) / f"replica-{entry.index}.log") for entry in plan.replicas]
    started = time.monotonic()
    with _terminate_as_exit():
        try:
            for replica in replicas:
                replica.start()
                if replica.entry.sequential_start:
                    wait_healthy([replica], timeout_s)
            wait_healthy(replicas, timeout_s)
            release_ports(ports)  # bound now: another run's check sees them taken
            shared_ports = [problem for r in replicas if (problem := r.port_owner_problem())]
            if shared_ports:
                raise FleetError("; ".join(shared_ports))
            log.info("fleet of %d healthy after %.1f s", len(replicas), time.monotonic() - started)
            yield replicas
        finally:
            release_ports(ports)
            with _signals_held():
                for replica in replicas:
                    replica.stop()


def pool_server(entry: dict, log_dir: Path) -> PoolServer:
    """The process of one planned pool server: a Redis server, or an LMCache MP server (plans written
    before servers had a kind are MP plans)."""
    if entry.kind == "redis":
        return RedisServer(entry, Path(log_dir) / f"redis-server-{entry.index}.log")
    return MPServer(entry, Path(log_dir) / f"lmcache-server-{entry.index}.log")


@contextmanager
def running_servers(plan: Plan, log_dir: Path, timeout_s: float):
    """Start the plan's pool servers (LMCache MP or Redis; none for other backends), wait for health,
    yield the plan (ports resolved) and the servers, and always stop them all."""
    plan, ports = claimed(plan, resolve_server_ports,
                          lambda plan: [port for server in plan.servers for port in _server_ports(server)])
    servers = [pool_server(entry, log_dir) for entry in plan.servers]
    with _terminate_as_exit():
        try:
            for server in servers:
                server.start()
            wait_healthy(servers, timeout_s)
            release_ports(ports)
            yield plan, servers
        finally:
            release_ports(ports)
            with _signals_held():
                for server in servers:
                    server.stop()


@contextmanager
def _signals_held():
    """Hold SIGINT and SIGTERM back while processes stop: a Ctrl-C that lands mid-stop would otherwise
    abort it and leave the rest running. The signals are delivered (and raise) once every stop is done."""
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextmanager
def _terminate_as_exit():
    """Turn SIGTERM into SystemExit while a fleet runs, so the stop path runs on `kill` too."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
