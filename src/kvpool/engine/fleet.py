"""Starting and stopping a fleet of vLLM replicas: own process groups, health waits, nothing left behind."""

from __future__ import annotations

import fcntl
import itertools
import json
import logging
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import psutil
import yaml

from kvpool.engine import mp, redis_pool
from kvpool.engine.plan import SERVED_MODEL_NAME, with_port, with_server_ports

log = logging.getLogger(__name__)


class FleetError(RuntimeError):
    """A replica or pool server failed to start, died, or could not be reached."""


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


def resolve_ports(plan: dict) -> dict:
    """The plan with its ports checked free; auto ports that were taken since planning are replaced."""
    replicas = plan["replicas"]
    taken = [r for r in replicas if not port_is_free(r["host"], r["port"])]
    if not taken:
        return plan
    names = ", ".join(f"replica {r['index']} port {r['port']}" for r in taken)
    if plan["port_source"] != "auto":
        raise FleetError(f"configured ports are in use on this machine: {names}; free them or set engine.ports")
    fresh = iter(free_ports(replicas[0]["host"], len(taken), exclude={r["port"] for r in replicas}))
    moved = {r["index"]: next(fresh) for r in taken}
    log.warning("planned ports taken since planning (%s); moved to %s", names, moved)
    return {**plan, "replicas": [with_port(r, moved[r["index"]]) if r["index"] in moved else r for r in replicas]}


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except FileNotFoundError:
        return "(no log)"


class ManagedProcess:
    """One server process (and its children) in a process group of its own."""

    kind = "process"

    def __init__(self, entry: dict, log_path: Path, url: str):
        self.entry = entry
        self.index = entry["index"]
        self.name = f"{self.kind} {self.index}"
        self.url = url
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.family: list[psutil.Process] = []  # every process of it seen so far (remember_family)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.entry["argv"], env={**os.environ, **self.entry["env"]}, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        log.info("%s started: pid %d, %s, log %s", self.name, self.proc.pid, self.url, self.log_path)
        self.remember_family()

    def remember_family(self) -> None:
        """Record the leader and its descendants now, so that a stop reaches them even after the leader
        died and they were re-parented (a killed API server leaves its engine core behind)."""
        try:
            leader = psutil.Process(self.proc.pid)
            found = [leader] + leader.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        self.family += [p for p in found if p not in self.family]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        raise NotImplementedError

    def died_error(self) -> FleetError:
        code = self.proc.returncode if self.proc else None
        return FleetError(f"{self.name} ({self.url}) exited with code {code}; "
                          f"last lines of {self.log_path}:\n{log_tail(self.log_path)}")

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the leader, then the whole process group and every process of it ever seen, then SIGKILL
        whatever is left."""
        if self.proc is None:
            return
        self.remember_family()
        # The leader alone first: vLLM's API server then shuts its engine down in order, and the engine's
        # KV connector unregisters its GPU KV cache from an LMCache MP server (a signalled engine core
        # does not, and the server keeps that GPU memory mapped after the replica is gone).
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            _still_running(self.family[:1], grace_s)
        members = self.family
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            for member in _still_running(members, 0.0):  # re-parented or regrouped members, one by one
                try:
                    member.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            members = _still_running(members, wait_s)
            if not members:
                break
        self.proc.wait(timeout=10)
        log.info("%s stopped", self.name)


# LMCache's engine names its RPC sockets in the replica's log ("... with socket path
# /tmp/engine_<id>_service_lookup_lmcache_rpc_port_0"), and leaves them, with their offload twins, behind.
LMCACHE_SOCKET = re.compile(r"socket path (/\S*?/engine_[0-9a-f-]+_service_)\S*")


def lmcache_sockets(log_text: str) -> list[Path]:
    """The socket files of the LMCache engines a replica's log names, that exist: every service of each."""
    prefixes = {Path(match[1]) for match in LMCACHE_SOCKET.finditer(log_text)}
    return sorted(path for prefix in prefixes for path in prefix.parent.glob(f"{prefix.name}*")
                  if path.is_socket() or path.is_file())


class Replica(ManagedProcess):
    """One vLLM server."""

    kind = "replica"

    def __init__(self, entry: dict, log_path: Path):
        super().__init__(entry, log_path, f"http://{entry['host']}:{entry['port']}")

    def start(self) -> None:
        if self.entry["lmcache_config_file"]:
            Path(self.entry["lmcache_config_file"]).write_text(yaml.safe_dump(self.entry["lmcache_config"]))
        super().start()

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop it, then remove the RPC socket files its LMCache engine left (two in /tmp per start)."""
        super().stop(grace_s)
        if self.proc is not None and self.log_path.exists():
            for path in lmcache_sockets(self.log_path.read_text(errors="replace")):
                path.unlink(missing_ok=True)

    def port_owner_problem(self) -> str | None:
        """Why requests to this replica's port might reach another process, or None.

        vLLM listens with SO_REUSEPORT, so a second vLLM (another run that planned the same free port at
        the same moment) binds the same port without error and the kernel splits connections between
        them: requests, hits and /metrics would silently mix two fleets.
        """
        ours = {p.pid for p in self.family}
        others = sorted({str(c.pid) for c in psutil.net_connections(kind="tcp")
                         if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.entry["port"]
                         and c.pid not in ours})
        if not others:
            return None
        return (f"{self.name}'s port {self.entry['port']} is also listened on by pid {', '.join(others)} (another "
                "vLLM server shares it through SO_REUSEPORT, e.g. a second kvpool run on this machine), so "
                "requests could reach it; stop that run or give this one its own engine.ports")

    def healthy(self) -> bool:
        """Answers /health and serves our model: another server that took the port does not count."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                if response.status != 200:
                    return False
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as response:
                served = [m.get("id") for m in json.loads(response.read()).get("data", [])]
            return SERVED_MODEL_NAME in served
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def served(self) -> dict:
        """What this replica runs, by its own word, once healthy: the model length /v1/models reports and the
        chunk sizes its LMCache engine logged (none where it logs none: no connector, a pool server's
        chunks, or an external replica's log that is not ours), or why they could not be read."""
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=30) as response:
                lengths = sorted({m.get("max_model_len") for m in json.loads(response.read()).get("data", [])
                                  if m.get("id") == SERVED_MODEL_NAME}, key=str)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            return {"error": f"{self.name}: /v1/models could not be read: {exc}"}
        text = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
        chunks = sorted({int(size) for size in re.findall(r"\bchunk_size'?: (\d+)", text)})
        return {"max_model_len": lengths[0] if len(lengths) == 1 else lengths, "chunk_sizes": chunks}


class ExternalReplica(Replica):
    """A replica someone else runs (fleet.mode: external): asked, never started or stopped. Its process
    is not ours to see, so it counts as alive; a request it fails is recorded with its error."""

    kind = "external replica"

    def __init__(self, entry: dict):
        ManagedProcess.__init__(self, entry, Path(os.devnull), entry["url"].rstrip("/"))

    def stop(self, grace_s: float = 30.0) -> None:
        """Nothing to stop: the fleet outlives the phase."""

    def alive(self) -> bool:
        return True

    def remember_family(self) -> None:
        """No process of ours."""

    def port_owner_problem(self) -> str | None:
        return None

    def died_error(self) -> FleetError:
        return FleetError(f"{self.name} ({self.url}) is not healthy (/health, or {SERVED_MODEL_NAME} not in "
                          "/v1/models: serve it with --served-model-name <name> kvpool-model)")


class MPServer(ManagedProcess):
    """One LMCache multi-process server (the lmcache-mp pool): ZMQ for replicas, HTTP for health and metrics."""

    kind = "lmcache server"
    pool_bytes_metric = mp.L1_BYTES

    def __init__(self, entry: dict, log_path: Path):
        super().__init__(entry, log_path, f"http://{entry['host']}:{entry['http_port']}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/healthcheck", timeout=5) as response:
                return response.status == 200 and json.loads(response.read()).get("status") == "healthy"
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def metrics(self) -> dict[str, float]:
        """The server's lookup, L1 and L2 counters now."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            return mp.server_metrics(response.read().decode())

    def registered(self) -> list:
        """The engine instances whose GPU KV caches the server holds mapped now."""
        with urllib.request.urlopen(f"{self.url}/status", timeout=30) as response:
            return mp.registered_engines(json.loads(response.read()))

    def await_released(self, timeout_s: float, poll_s: float = 1.0) -> dict:
        """Once a fleet has stopped, wait until the server has let go of every replica's GPU KV cache; how long
        that took. Raises FleetError while it still holds one after ``timeout_s``: the next fleet on that GPU
        would run out of memory (LMCache #4014, #4980; see ``mp.REPLICA_SHUTDOWN_TIMEOUT_S``)."""
        held, waited_s = _polled(self.registered, lambda held: not held, timeout_s, poll_s)
        if held:
            raise FleetError(
                f"{self.name} still holds the GPU KV cache of {len(held)} stopped replica(s) after {timeout_s:.0f} s "
                f"(its /status lists {held}): it keeps that GPU memory mapped, so the next fleet would run out of "
                "it. A replica's engine was killed before it unregistered (LMCache #4014, #4980), and the "
                "server's reaper (--worker-reap-timeout-seconds, 120 s by default) has not freed it within "
                "lmcache_mp.release_timeout_s")
        if waited_s >= poll_s:
            log.warning("%s let go of the stopped replicas' GPU KV caches after %.0f s", self.name, waited_s)
        return {"waited_s": waited_s}

    def drain(self, timeout_s: float, poll_s: float = 1.0) -> dict:
        """Wait until every L2 store the server accepted is written; the stores still pending at the end."""
        pending, waited_s = _polled(lambda: mp.l2_pending(self.metrics()), lambda pending: pending <= 0,
                                    timeout_s, poll_s)
        if pending > 0:
            log.error("%s still had %d L2 stores pending after %.0f s", self.name, pending, timeout_s)
        return {"pending_l2_stores": pending, "waited_s": waited_s}


class RedisServer(ManagedProcess):
    """One Redis server (the lmcache-redis pool): the replicas' LMCache connectors and kvpool's own
    counting client speak RESP to it on its one port."""

    kind = "redis server"
    pool_bytes_metric = redis_pool.POOL_BYTES

    def __init__(self, entry: dict, log_path: Path):
        super().__init__(entry, log_path, redis_pool.url(entry["host"], entry["port"]))

    def start(self) -> None:
        Path(self.entry["workdir"]).mkdir(parents=True, exist_ok=True)
        super().start()

    def connection(self):
        """A client of this server (a context manager): kvpool's own counting, and a unit that sets the
        server while it runs."""
        return redis_pool.client(self.entry["host"], self.entry["port"])

    def healthy(self) -> bool:
        """Answers PING, and is the server this process started (another one could hold the port)."""
        import redis

        try:
            with self.connection() as conn:
                return bool(conn.ping()) and conn.info("server")["process_id"] == self.proc.pid
        except (redis.RedisError, OSError):
            return False

    def metrics(self) -> dict[str, float]:
        """The pool's KV bytes and chunks, and the server's memory, now."""
        import redis

        try:
            with self.connection() as conn:
                return redis_pool.pool_metrics(conn)
        except redis.RedisError as exc:  # the phase records a server it cannot read (an OSError) as failed
            raise OSError(f"{self.name} ({self.url}): {exc}") from exc

    def digest_rows(self) -> list[dict]:
        """Every chunk's KV value the server holds, digested; its copy is the arm's pool name (the server's
        working directory: shared, replica-N), as a file pool's rows name their directory."""
        import redis

        try:
            with self.connection() as conn:
                return redis_pool.digest_rows(conn, Path(self.entry["workdir"]).name)
        except redis.RedisError as exc:
            raise OSError(f"{self.name} ({self.url}): {exc}") from exc

    def drain(self, timeout_s: float, poll_s: float = 1.0) -> dict:
        """Nothing to wait for: a SET has been applied once LMCache's put returns."""
        return {"pending_l2_stores": 0, "waited_s": 0.0}

    def await_released(self, timeout_s: float, poll_s: float = 1.0) -> dict:
        """Nothing to wait for: Redis maps no replica's GPU memory."""
        return {"waited_s": 0.0}


def _polled(read, done, timeout_s: float, poll_s: float):
    """``read()`` every ``poll_s`` until ``done`` holds for its value or ``timeout_s`` has passed (read once
    more then); the last value and the seconds waited."""
    started = time.monotonic()
    while not done(value := read()) and time.monotonic() - started < timeout_s:
        time.sleep(poll_s)
    return value, round(time.monotonic() - started, 3)


# A pool server of either kind: what phases hand around when a memory pool's servers run already
PoolServer = MPServer | RedisServer


def _still_running(members: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """The members that have not exited within ``timeout_s``. A zombie has exited: an engine's
    child orphaned by its parent's exit waits for PID 1 to reap it, which can take long."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = []
        for member in members:
            try:
                if member.status() != psutil.STATUS_ZOMBIE:
                    running.append(member)
            except psutil.NoSuchProcess:
                pass
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.1)


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
def running_fleet(plan: dict, log_dir: Path, timeout_s: float):
    """Start every replica of ``plan``, wait for health, yield them, and always stop them all. An
    external fleet's replicas are only waited for: kvpool starts and stops none of them."""
    if plan.get("external"):
        replicas = [ExternalReplica(entry) for entry in plan["replicas"]]
        # a deployed fleet is up already: wait its own short while, not a launched replica's startup
        wait_healthy(replicas, plan.get("wait_s", timeout_s))
        log.info("external fleet of %d healthy", len(replicas))
        yield replicas
        return
    plan, ports = claimed(plan, resolve_ports, lambda plan: [r["port"] for r in plan["replicas"]])
    replicas = [Replica(entry, Path(log_dir) / f"replica-{entry['index']}.log") for entry in plan["replicas"]]
    started = time.monotonic()
    with _terminate_as_exit():
        try:
            for replica in replicas:
                replica.start()
                if replica.entry["sequential_start"]:
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


def claimed(plan: dict, resolve, ports_of) -> tuple[dict, list[int]]:
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
    return [port for port in (server["port"], server.get("http_port")) if port is not None]


def resolve_server_ports(plan: dict) -> dict:
    """The plan with its pool servers' ports checked free; taken ones move, with their replicas' connectors."""
    for server in plan.get("servers", []):
        ports = _server_ports(server)
        if all(port_is_free(server["host"], port) for port in ports):
            continue
        in_use = {p for s in plan["servers"] for p in _server_ports(s)} | {r["port"] for r in plan["replicas"]}
        fresh = free_ports(server["host"], len(ports), exclude=in_use)
        log.warning("pool server %d ports %s taken since planning; moved to %s", server["index"], ports, fresh)
        plan = with_server_ports(plan, server["index"], fresh[0], fresh[1] if len(fresh) > 1 else None)
    return plan


def pool_server(entry: dict, log_dir: Path) -> PoolServer:
    """The process of one planned pool server: a Redis server, or an LMCache MP server (plans written
    before servers had a kind are MP plans)."""
    if entry.get("kind") == "redis":
        return RedisServer(entry, Path(log_dir) / f"redis-server-{entry['index']}.log")
    return MPServer(entry, Path(log_dir) / f"lmcache-server-{entry['index']}.log")


@contextmanager
def running_servers(plan: dict, log_dir: Path, timeout_s: float):
    """Start the plan's pool servers (LMCache MP or Redis; none for other backends), wait for health,
    yield the plan (ports resolved) and the servers, and always stop them all."""
    plan, ports = claimed(plan, resolve_server_ports,
                          lambda plan: [port for server in plan.get("servers", []) for port in _server_ports(server)])
    servers = [pool_server(entry, log_dir) for entry in plan.get("servers", [])]
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
