"""The processes a fleet is made of (vLLM replicas, LMCache MP and Redis pool servers, an external
fleet's replicas): each started in a process group of its own, asked whether it is healthy, and stopped
with nothing left behind."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections import deque
from datetime import datetime
from pathlib import Path

import psutil
import yaml

from kvpool.engine import mp, redis_pool
from kvpool.engine.errors import FleetError
from kvpool.engine.plan import SERVED_MODEL_NAME

log = logging.getLogger(__name__)


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except FileNotFoundError:
        return "(no log)"


# The line that opens each start's section of a process's log. Logs append (a unit measured again, or a
# unit of another config whose logs share the path, adds its own section), so what a check reads of a log
# is the last start's section alone: this_start.
START_MARK = "=== kvpool starts "
_START_LINE = re.compile(rf"^{re.escape(START_MARK)}", re.MULTILINE)


def this_start(text: str) -> str:
    """The section of a log's ``text`` that its last start wrote (all of it, for a log without a start line)."""
    starts = [match.start() for match in _START_LINE.finditer(text)]
    return text[starts[-1]:] if starts else text


_PR_SET_PDEATHSIG = 1  # prctl(2)
_LIBC = ctypes.CDLL(None, use_errno=True)


def _dies_with(parent_pid: int):
    """A preexec_fn: the child is sent SIGTERM when the thread that started it exits, as when the job's
    process is killed with SIGKILL, which runs no stop path (SIGTERM, so that a vLLM API server still stops
    its engine core, and a pool server exits on its own). The job starts every process from its main thread,
    which lives as long as the job. A parent gone before the call leaves the child no one to outlive."""
    def preexec():
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:
            os._exit(1)
    return preexec


class ManagedProcess:
    """One server process (and its children) in a process group of its own, that does not outlive the job
    that started it (_dies_with)."""

    kind = "process"

    def __init__(self, entry: dict, log_path: Path, url: str):
        self.entry = entry
        self.index = entry.index
        self.name = f"{self.kind} {self.index}"
        self.url = url
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.family: list[psutil.Process] = []  # every process of it seen so far (remember_family)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            out.write(f"{START_MARK}{self.name} at {datetime.now().astimezone().isoformat(timespec='seconds')}, "
                      f"attempt {uuid.uuid4().hex[:12]} ===\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.entry.argv, env={**os.environ, **self.entry.env}, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_dies_with(os.getpid()),
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

    def log_text(self) -> str:
        """What this start of the process has logged (its section of the log, empty before it logs)."""
        return this_start(self.log_path.read_text(errors="replace")) if self.log_path.is_file() else ""

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


# vLLM's offloading connector (vllm-fs) maps each replica's CPU tier from /dev/shm/vllm_offload_<engine id>.mmap
# (the whole cpu_bytes_to_use, faulted in at start), which only the engine core's own teardown removes. On the lent
# H100 (2026-12-06, vLLM 0.26.0) every stopped replica left its 16 GiB region behind, and three of them took the
# host memory the next cells needed: a replica's engine core and an MP server were killed (-9).
OFFLOAD_REGION = re.compile(r"/dev/shm/vllm_offload_[0-9a-f-]+\.mmap")


def offload_regions(processes: list[psutil.Process]) -> set[Path]:
    """The offload regions (``OFFLOAD_REGION``) ``processes`` have mapped and not yet removed."""
    found = set()
    for process in processes:
        try:
            maps = process.memory_maps(grouped=True)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        found |= {Path(region.path) for region in maps if OFFLOAD_REGION.fullmatch(region.path)}
    return found


def lmcache_sockets(log_text: str) -> list[Path]:
    """The socket files of the LMCache engines a replica's log names, that exist: every service of each."""
    prefixes = {Path(match[1]) for match in LMCACHE_SOCKET.finditer(log_text)}
    return sorted(path for prefix in prefixes for path in prefix.parent.glob(f"{prefix.name}*")
                  if path.is_socket() or path.is_file())


class Replica(ManagedProcess):
    """One vLLM server."""

    kind = "replica"

    def __init__(self, entry: dict, log_path: Path):
        super().__init__(entry, log_path, f"http://{entry.host}:{entry.port}")
        self.regions: set[Path] = set()  # its offload regions, as seen healthy and at its stop

    def start(self) -> None:
        if self.entry.lmcache_config_file:
            Path(self.entry.lmcache_config_file).write_text(yaml.safe_dump(self.entry.lmcache_config))
        super().start()

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop it, then remove the RPC socket files its LMCache engine left (two in /tmp per start) and the
        offload regions its engine mapped (a vllm-fs replica's CPU tier in /dev/shm)."""
        if self.proc is not None:
            self.remember_family()
            self.regions |= offload_regions(self.family)
        super().stop(grace_s)
        if self.proc is not None:
            for path in lmcache_sockets(self.log_text()) + sorted(self.regions):
                path.unlink(missing_ok=True)

    def port_owner_problem(self) -> str | None:
        """Why requests to this replica's port might reach another process, or None.

        vLLM listens with SO_REUSEPORT, so a second vLLM (another run that planned the same free port at
        the same moment) binds the same port without error and the kernel splits connections between
        them: requests, hits and /metrics would silently mix two fleets.
        """
        ours = {p.pid for p in self.family}
        others = sorted({str(c.pid) for c in psutil.net_connections(kind="tcp")
                         if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.entry.port
                         and c.pid not in ours})
        if not others:
            return None
        return (f"{self.name}'s port {self.entry.port} is also listened on by pid {', '.join(others)} (another "
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
        except (urllib.error.URLError, OSError, ValueError):
            return False
        if SERVED_MODEL_NAME in served and self.proc is not None:  # its engine is up: note what it mapped
            self.remember_family()
            self.regions |= offload_regions(self.family)
        return SERVED_MODEL_NAME in served

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
        chunks = sorted({int(size) for size in re.findall(r"\bchunk_size'?: (\d+)", self.log_text())})
        return {"max_model_len": lengths[0] if len(lengths) == 1 else lengths, "chunk_sizes": chunks}


class ExternalReplica(Replica):
    """A replica someone else runs (fleet.mode: external): asked, never started or stopped. Its process
    is not ours to see, so it counts as alive; a request it fails is recorded with its error."""

    kind = "external replica"

    def __init__(self, entry: dict):
        ManagedProcess.__init__(self, entry, Path(os.devnull), entry.url.rstrip("/"))
        self.regions = set()

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
        super().__init__(entry, log_path, f"http://{entry.host}:{entry.http_port}")

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

    def clear(self) -> dict:
        """Empty the server's L1 (LMCache's ``POST /cache/clear``: every object no request holds locked); its bytes
        before and after (``_emptied``)."""
        return _emptied(self, self._clear_l1)

    def _clear_l1(self) -> None:
        request = urllib.request.Request(f"{self.url}/cache/clear", method="POST",
                                         data=json.dumps({"tier": "l1", "force": False}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        if answer.get("status") != "ok":
            raise OSError(f"{self.name} ({self.url}): /cache/clear answered {answer}")

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
        super().__init__(entry, log_path, redis_pool.url(entry.host, entry.port))

    def start(self) -> None:
        Path(self.entry.workdir).mkdir(parents=True, exist_ok=True)
        super().start()

    def connection(self):
        """A client of this server (a context manager): kvpool's own counting, and a unit that sets the
        server while it runs."""
        return redis_pool.client(self.entry.host, self.entry.port)

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
                return redis_pool.digest_rows(conn, Path(self.entry.workdir).name)
        except redis.RedisError as exc:
            raise OSError(f"{self.name} ({self.url}): {exc}") from exc

    def clear(self) -> dict:
        """Empty the server (FLUSHALL); the pool's KV bytes before and after (``_emptied``)."""
        return _emptied(self, self._flush)

    def _flush(self) -> None:
        import redis

        try:
            with self.connection() as conn:
                conn.flushall()
        except redis.RedisError as exc:
            raise OSError(f"{self.name} ({self.url}): {exc}") from exc

    def drain(self, timeout_s: float, poll_s: float = 1.0) -> dict:
        """Nothing to wait for: a SET has been applied once LMCache's put returns."""
        return {"pending_l2_stores": 0, "waited_s": 0.0}

    def await_released(self, timeout_s: float, poll_s: float = 1.0) -> dict:
        """Nothing to wait for: Redis maps no replica's GPU memory."""
        return {"waited_s": 0.0}


def _emptied(server: PoolServer, empty) -> dict:
    """``empty()`` run on ``server`` (between an isolated arm's reloads of a document), with the pool bytes its
    metrics give before and after. Raises OSError where the server does not answer."""
    held = lambda: server.metrics().get(server.pool_bytes_metric)  # noqa: E731
    before = held()
    empty()
    return {"server": server.name, "bytes_before": before, "bytes_after": held()}


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
