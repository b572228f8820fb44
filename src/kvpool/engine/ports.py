"""Ports a fleet's servers will listen on: found free, claimed machine-wide until the server on each is
healthy, and moved off when another run took them since planning."""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import socket
import tempfile
from pathlib import Path

import psutil

from kvpool.engine.errors import FleetError, PortsInUse
from kvpool.engine.plan import with_port, with_server_ports
from kvpool.engine.plan_types import Plan

log = logging.getLogger(__name__)


# Ports a kvpool process is starting a server on, machine-wide: one lock file per port, held (flock) from
# the check that the port is free until the server on it is healthy, so two runs that plan at the same
# moment never both take one. The kernel drops a lock when its process exits, however it exits.
PORT_CLAIMS = Path(tempfile.gettempdir()) / "kvpool-port-claims"
_held: dict[int, int] = {}  # port -> the open lock file this process holds it by


def claim_port(port: int) -> bool:
    """Hold ``port`` for a server this process is about to start; False if another process holds it."""
    if port in _held:
        return True
    try:
        fd = os.open(_claims_folder() / f"{port}.lock", os.O_CREAT | os.O_RDWR, 0o666)
    except PermissionError:  # another user's lock file: that user's runs are told apart by the bound port
        fd = os.open(_claims_folder(per_user=True) / f"{port}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _held[port] = fd
    return True


def _claims_folder(per_user: bool = False) -> Path:
    """The lock files' folder, shared by every user (sticky and world-writable, as /tmp is), or this
    user's own where another user's files cannot be opened."""
    folder = PORT_CLAIMS.with_name(f"{PORT_CLAIMS.name}-{os.getuid()}") if per_user else PORT_CLAIMS
    if not folder.is_dir():
        folder.mkdir(exist_ok=True)
        if not per_user:
            os.chmod(folder, 0o1777)  # mkdir's mode is cut by the umask
    return folder


def release_ports(ports) -> None:
    """Let go of ``ports`` (their servers listen on them now, or never will)."""
    for port in ports:
        if (fd := _held.pop(port, None)) is not None:
            os.close(fd)


def claimed_elsewhere(port: int) -> bool:
    """Whether another process holds ``port`` for a server it is starting."""
    if port in _held:
        return False
    if not claim_port(port):
        return True
    release_ports([port])
    return False


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``port`` now, and no other kvpool run is starting one on it; like
    uvicorn, TIME_WAIT leftovers do not count."""
    if claimed_elsewhere(port):
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def port_holder(port: int) -> str:
    """Who holds ``port``, as a refusal names it: each process with a socket on it (pid and command line;
    psutil maps /proc's sockets to processes, and sees other users' only as root), or why none is named."""
    sockets = [c for c in psutil.net_connections(kind="inet") if c.laddr and c.laddr.port == port]
    holders = []
    for pid in sorted({c.pid for c in sockets if c.pid}):
        try:
            holders.append(f"pid {pid} ({' '.join(psutil.Process(pid).cmdline())[:120]})")
        except psutil.Error:
            holders.append(f"pid {pid}")
    if holders:
        return "held by " + ", ".join(holders)
    if sockets:
        return "held by a process of another user (run as root to see which)"
    return "claimed by another kvpool run starting a server on it" if claimed_elsewhere(port) else "no holder seen"


def free_ports(host: str, count: int, start: int = 18100, span: int = 10000, exclude=()) -> list[int]:
    """``count`` ports free on ``host`` right now, from ``start`` on, none of ``exclude`` (ports already
    planned for something else); the default range sits below the kernel's ephemeral ports, so
    client connections never take them."""
    stop = start + span
    exclude = set(exclude)
    candidates = (port for port in range(start, stop) if port not in exclude and port_is_free(host, port))
    found = list(itertools.islice(candidates, count))  # checked one at a time, up to the count
    if len(found) < count:
        raise FleetError(f"no {count} free ports on {host} in {start}..{stop}")
    return found


def resolve_ports(plan: Plan) -> dict:
    """The plan with its ports checked free; auto ports that were taken since planning are replaced."""
    replicas = plan.replicas
    taken = [r for r in replicas if not port_is_free(r.host, r.port)]
    if not taken:
        return plan
    names = ", ".join(f"replica {r.index} port {r.port}" for r in taken)
    if plan.port_source != "auto":
        names = ", ".join(f"replica {r.index} port {r.port} ({port_holder(r.port)})" for r in taken)
        raise PortsInUse(f"configured ports are in use on this machine: {names}; free them or set engine.ports")
    fresh = iter(free_ports(replicas[0].host, len(taken), exclude={r.port for r in replicas}))
    moved = {r.index: next(fresh) for r in taken}
    log.warning("planned ports taken since planning (%s); moved to %s", names, moved)
    return plan.with_replicas(with_port(r, moved[r.index]) if r.index in moved else r for r in replicas)


def claimed(plan: Plan, resolve, ports_of) -> tuple[dict, list[int]]:
    """``resolve(plan)`` (its ports checked free, taken auto ports moved) with every one of ``ports_of`` it
    then names held for this process (``claim_port``), and those ports. A port another run claims between
    the check and the claim is checked again, so it moves (auto) or is refused by name (configured)."""
    for _ in range(5):
        plan = resolve(plan)
        ports = ports_of(plan)
        got = [port for port in ports if claim_port(port)]
        if len(got) == len(ports):
            return plan, ports
        release_ports(got)
    raise FleetError(f"ports {ports} were claimed by other kvpool runs on this machine five times over; "
                     "retry, or give each run its own engine.ports")


def _server_ports(server: dict) -> list[int]:
    return [port for port in (server.port, server.http_port) if port is not None]


def resolve_server_ports(plan: Plan) -> dict:
    """The plan with its pool servers' ports checked free; taken ones move, with their replicas' connectors."""
    for server in plan.servers:
        ports = _server_ports(server)
        if all(port_is_free(server.host, port) for port in ports):
            continue
        in_use = {p for s in plan.servers for p in _server_ports(s)} | {r.port for r in plan.replicas}
        fresh = free_ports(server.host, len(ports), exclude=in_use)
        log.warning("pool server %d ports %s taken since planning; moved to %s", server.index, ports, fresh)
        plan = with_server_ports(plan, server.index, fresh[0], fresh[1] if len(fresh) > 1 else None)
    return plan
