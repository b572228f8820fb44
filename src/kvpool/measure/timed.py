"""One timed unit on a fleet, the same for every unit kind: on its own pool (its plan and pool:
kvpool.measure.unit_plan), the fleet started and stopped around it, each request measured and its hits
proven from the serving replica's counters, telemetry sampled over its window, and its records archived
and written."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import subprocess
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import aiohttp
import pandas as pd
from tqdm import tqdm

from kvpool.cells import Cell
from kvpool.engine import metrics, mp
from kvpool.engine.backends import pool_backend
from kvpool.engine.client import RequestResult, complete, new_session
from kvpool.engine.errors import FleetError
from kvpool.engine.fleet import running_fleet, running_servers
from kvpool.engine.plan import plan_gpus, plan_pool_dirs
from kvpool.engine.plan_types import Plan
from kvpool.engine.pool_files import TEMP_SUFFIX, drop_from_page_cache, pool_files
from kvpool.engine.processes import PoolServer, Replica
from kvpool.measure import kvbytes, records
from kvpool.measure import reference as split_reference
from kvpool.measure.drive import iostat
from kvpool.measure.files import read_frame_or_empty
from kvpool.measure.telemetry import Sampler, fleet_gpus_only, summarize_drive, summarize_power
from kvpool.measure.unit import UnitResult
from kvpool.measure.unit_plan import reference_replica

log = logging.getLogger(__name__)
# vLLM's /reset_prefix_cache fails while a block is still held (an offloading store copying the last request's
# blocks out takes milliseconds to seconds): asked again this many times, this far apart
RESET_ATTEMPTS, RESET_WAIT_S = 20, 0.5


def pool_digests(dirs: list[Path], servers=None, populate: pd.DataFrame | None = None) -> pd.DataFrame:
    """The pool's chunks digested: a Redis pool's values from its servers, else the pool's files (an MP
    memory pool has none: its L1 cannot be read from outside)."""
    if servers and all(hasattr(server, "digest_rows") for server in servers):
        return kvbytes.with_stored_in([row for server in servers for row in server.digest_rows()], populate)
    return kvbytes.pool_digests(dirs, populate)


def refuse_failed_reference(frame: pd.DataFrame) -> None:
    """A reference that could not compute every request would leave answers unverified: stop, naming why."""
    failed = frame[frame["error"].fillna("") != ""]
    if len(failed):
        for row in failed.head(5).itertuples():
            log.error("reference request %s, split %s, failed: %s", row.key, row.requested_split, row.error)
        raise RuntimeError(f"{len(failed)} of {len(frame)} reference requests failed, e.g. {failed['key'].iloc[0]} "
                           f"split {failed['requested_split'].iloc[0]}: {failed['error'].iloc[0]}")


def phase_summary(raw_drive: pd.DataFrame, power: pd.DataFrame, telemetry: dict, requests: int,
                  gpus: list[int]) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """One timed window's telemetry (a phase, or a load level): the raw drive samples with iostat's
    derived columns for the interval each closes, the fleet's GPUs' power samples alone (a sampler may
    read every GPU of the host) and the window's summary."""
    derived = iostat(raw_drive) if not raw_drive.empty else pd.DataFrame()
    if not raw_drive.empty:
        raw_drive = raw_drive.merge(derived.drop(columns=["phase", "cell"], errors="ignore"), on=["t_s", "device"],
                                    how="left")
    meta, power = fleet_gpus_only(telemetry, power, gpus)
    summary = {"started_at": meta["started_at"], "finished_at": meta["finished_at"], "duration_s": meta["duration_s"],
               "hz": meta["hz"], "devices": meta["devices"], "disks": meta["disks"],
               "drive": summarize_drive(derived, meta["duration_s"]), "power": summarize_power(power, meta, requests),
               "health_before": meta["health_before"], "health_after": meta["health_after"]}
    return raw_drive, power, summary


def write_unit(meta: dict, requests: int, drive_csv: str, power_csv: str, plan: Plan, json_out: str,
                name: str) -> None:
    """A measured unit's record (a load level's, a router unit's, a length unit's), its telemetry window summarized
    beside its gate, and each failed check logged under ``name``."""
    _, _, window = phase_summary(read_frame_or_empty(drive_csv), read_frame_or_empty(power_csv), meta["telemetry"],
                                 requests, plan_gpus(plan))
    meta["summary"] = {"drive": window["drive"], "power": window["power"]}
    records.write_meta(meta, json_out)
    for check_name, check in meta["checks"].items():
        if check["ok"] is False:
            log.error("%s invalid: %s is %s (needs %s)", name, check_name, check["value"], check["threshold"])


def recompute_in_splits(config: dict, model: str, measured: pd.DataFrame, prompts: dict[str, list[int]],
                     known: pd.DataFrame, log_dir: Path) -> pd.DataFrame:
    """The reference rows for ``measured`` (requests keyed by payload): those of ``known`` for its
    prompts, and every (prompt, split) none of them matches, computed now on one replica with no pool."""
    known = split_reference.normalized(known)
    requests = split_reference.requests_for(split_reference.missing(measured, known), prompts)
    used = known[known["key"].isin(set(measured["key"]))]
    if not requests:
        return used
    log.info("reference: %d prompts in their measured splits on a replica with no pool", len(requests))
    computed = reference_phase(reference_replica(config, model), requests, config, log_dir)
    refuse_failed_reference(computed)
    return pd.concat([used, computed], ignore_index=True)


async def measured_request(session: aiohttp.ClientSession, replica: Replica, prompt: list[int], output_tokens: int,
                    timeout_s: float, cache_salt: str | None = None,
                    token_ids: bool = False) -> tuple[RequestResult, dict[str, int]]:
    """One request and the serving replica's token-counter deltas around it (one request in flight per replica).

    Failures come back as data: a replica that cannot be scraped or has died gives a row whose error
    names it (its exit code and log tail), and the phase goes on, so the rows measured so far are kept.
    """
    try:
        before = await metrics.scrape(session, replica.url)
    except (aiohttp.ClientError, TimeoutError) as exc:
        await asyncio.to_thread(await_exit, replica, 2.0)  # as below: let a dead replica's exit show
        return RequestResult(error=replica_error(replica, "its /metrics before the request", exc)), {}
    result = await complete(session, replica.url, prompt, output_tokens, timeout_s, cache_salt, token_ids)
    try:
        after = await metrics.scrape(session, replica.url)
    except (aiohttp.ClientError, TimeoutError) as exc:
        # a server that stopped answering has usually just died: give its exit a moment to show
        await asyncio.to_thread(await_exit, replica, 2.0)
        result.error = replica_error(replica, "the request" if result.error else "its /metrics after the request",
                                      result.error or exc)
        return result, {}
    if result.error:
        result.error = replica_error(replica, "the request", result.error)
    return result, metrics.delta(after, before)


def await_exit(replica: Replica, timeout_s: float) -> None:
    if replica.proc is None:  # an external replica: no process of ours to wait for
        return
    try:
        replica.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass


def replica_error(replica: Replica, what: str, cause) -> str:
    """A failed request's error, naming the replica, and its exit code and log tail if it died."""
    if replica.alive():
        return f"replica {replica.index}: {what} failed: {cause}"
    return f"{what} failed ({cause}): {replica.died_error()}"


def request_row(doc_id: int, prefill: int | None, serve: int, result: RequestResult, counts: dict[str, int]) -> dict:
    row = dataclasses.asdict(result)
    row.update(doc_id=doc_id, prefill_replica=prefill, serve_replica=serve,
               external_hit_tokens=counts.get("external_kv_transfer"),
               local_compute_tokens=counts.get("local_compute"), local_cache_hit_tokens=counts.get("local_cache_hit"),
               **metrics.request_timings(counts))
    return {column: row.get(column) for column in records.columns(records.RequestRecord)}


def phase_sampler(plan: Plan, phase: str, disks: list[str], cfg: dict, replicas: list[Replica]) -> Sampler:
    gpus = plan_gpus(plan)
    return Sampler(plan.cell, phase, disks, cfg["telemetry_hz"],
                   pids=lambda: {r.index: r.proc.pid for r in replicas if r.proc is not None},
                   gpus=gpus or None)


def server_settings(cfg: dict, plan: Plan) -> dict:
    """The config section of the plan's pool servers: ``lmcache_redis`` for Redis servers, else ``lmcache_mp``
    (its startup and drain timeouts)."""
    redis = any(server.kind == "redis" for server in plan.servers)
    if redis:
        return {"drain_timeout_s": 0, "release_timeout_s": 0, **cfg["lmcache_redis"]}
    return cfg["lmcache_mp"]


@contextmanager
def pool_servers(plan: Plan, log_dir: Path, cfg: dict, servers: list[PoolServer] | None = None,
                 replicas_stop: bool = True):
    """The cell's LMCache MP servers for one phase, and what they did in it (``record``, filled on exit).

    Servers handed in (a memory pool, which lives only as long as its server) keep running; otherwise
    the phase starts its own and stops them. Before the record is taken, every L2 store a server
    accepted has reached the drive, so a server stopped afterwards loses nothing. A server that outlives
    the phase has also let go of its stopped replicas' GPU memory (``released``), which the next phase's
    fleet needs; one that does not within ``release_timeout_s`` stops the unit with the reason. Where the
    replicas outlive the phase too (``replicas_stop`` false), there is nothing to let go of yet.
    """
    handed_in = servers is not None
    record: dict = {}
    if not plan.servers:
        yield plan, [], record
        return
    settings = server_settings(cfg, plan)
    if servers is not None:
        planned = [(s.index, s.port, s.http_port) for s in plan.servers]
        serving = [(s.entry.index, s.entry.port, s.entry.http_port) for s in servers]
        if planned != serving:  # replicas would wait their whole startup for a server that is not there
            raise FleetError(f"the phase's plan names servers (index, port, http port) {planned}, "
                             f"but the running servers are {serving}")
    running = running_servers(plan, log_dir, settings["startup_timeout_s"]) if servers is None \
        else nullcontext((plan, servers))
    with running as (plan, servers):
        before = {s.index: s.metrics() for s in servers}
        yield plan, servers, record
        for server in servers:
            try:
                drain = server.drain(settings["drain_timeout_s"])
                after = server.metrics()
            except OSError as exc:  # a server that died mid-phase: its record says so, the phase's rows stay
                cause = server.died_error() if not server.alive() else exc
                record[str(server.index)] = {"drain": {"pending_l2_stores": None}, "metrics": {}, "l1_bytes": None,
                                             "error": f"{server.name}: {cause}"}
                log.error("%s could not be read after the phase: %s", server.name, cause)
                continue
            record[str(server.index)] = {"drain": drain, "metrics": mp.metrics_delta(after, before[server.index]),
                                         "l1_bytes": after.get(server.pool_bytes_metric)}
            if handed_in and replicas_stop:
                record[str(server.index)]["released"] = server.await_released(settings["release_timeout_s"])


async def reset_prefix_cache(session: aiohttp.ClientSession, replica: Replica, connector: bool = False,
                             attempts: int = RESET_ATTEMPTS, wait_s: float = RESET_WAIT_S) -> str:
    """Empty ``replica``'s own prefix cache through vLLM's /reset_prefix_cache (open with
    VLLM_SERVER_DEV_MODE), and with ``connector`` its connector's own tiers too (``reset_external``: vLLM's
    offloading CPU tier); an error message, or "" when vLLM reports success. vLLM answers {"success": false}
    while blocks are still held (a store of the last request's blocks still copying them), so that is asked
    again, ``attempts`` times ``wait_s`` apart. The next request's hit counters prove the reset."""
    params = {"reset_external": "true"} if connector else {}
    for attempt in range(attempts):
        try:
            async with session.post(f"{replica.url}/reset_prefix_cache", params=params,
                                    timeout=aiohttp.ClientTimeout(total=60)) as response:
                body = await response.text()
                if response.status != 200:
                    return (f"replica {replica.index}: /reset_prefix_cache answered HTTP {response.status}: "
                            f"{body[:200]}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            return replica_error(replica, "/reset_prefix_cache", exc)
        # older versions answer with no body
        if not body.strip().startswith("{") or json.loads(body).get("success", True):
            return ""
        if attempt + 1 < attempts:
            await asyncio.sleep(wait_s)
    return f"replica {replica.index}: /reset_prefix_cache reported no success {attempts} times (blocks still held)"


def settled_stores(dirs: list[Path], servers: list[PoolServer] | None, poll_s: float = 0.5,
                   timeout_s: float = 60.0, min_files: int = 0, chunk_suffix: str = "",
                   stop: threading.Event | None = None) -> dict:
    """Wait for the pool to stop changing: LMCache stores a request's chunks after its answer (its remote
    backend puts them asynchronously), so on a fleet that keeps running after populate the last stores may
    still be on their way. Settled is two reads ``poll_s`` apart that agree, with no temp file among the
    pool's files (the chunk files' names and sizes, and each server's pool bytes) and at least ``min_files``
    whole chunk files, named ``*chunk_suffix`` (a backend whose stores go on in the engine in two asynchronous
    hops, vllm-fs, gives the files every document's whole chunks make); at ``timeout_s`` the last read stands,
    and the gate's checks of what populate stored judge it. ``stop`` (set by a caller that was cancelled, a
    run's Ctrl-C) ends the wait at the next read, so no thread outlives its run by the timeout. Returns what
    was waited for."""
    def server_bytes(server: PoolServer) -> float | None:
        try:
            return server.metrics().get(server.pool_bytes_metric)
        except OSError:  # a server that died: its phase record names it, and nothing more will land in it
            return None

    def read() -> tuple[dict, tuple]:
        files = {}
        for path in pool_files(dirs):
            with contextlib.suppress(FileNotFoundError):  # a temp file renamed as it is listed
                files[str(path)] = path.stat().st_size
        return files, tuple(server_bytes(server) for server in servers or [])

    started, settled = time.monotonic(), False
    last = read()
    while not settled and time.monotonic() - started < timeout_s and not (stop and stop.is_set()):
        time.sleep(poll_s)
        now = read()
        whole = [name for name in now[0] if not name.endswith(TEMP_SUFFIX)]
        chunks = sum(1 for name in whole if name.endswith(chunk_suffix))
        settled = now == last and len(whole) == len(now[0]) and chunks >= min_files
        last = now
    if not settled:
        log.warning("the pool was still changing after %.0f s of waiting for its stores", timeout_s)
    files, held = last
    return {"settled": settled, "waited_s": round(time.monotonic() - started, 3), "files": len(files),
            "bytes": sum(files.values()), "server_pool_bytes": list(held), "min_files": min_files}


def landed_stores(plan: Plan, cfg: dict, whole_workload: bool = False, min_files: int = 0,
                  stop: threading.Event | None = None) -> dict | None:
    """Where the plan's backend stores to its pool's files only after the answer (vllm-fs), wait until they are
    whole and stop changing, and at least ``min_files`` chunk files (``whole_workload``: until every document's
    whole chunks are files, as populate's end does); None for every other backend, whose stores kvpool's phases
    already wait for."""
    if not stores_after_answer(plan):
        return None
    cell = Cell.from_name(plan.cell)
    settle = pool_backend(cell.backend).populate_settle(cfg, cell)
    return settled_stores(plan_pool_dirs(plan), None, stop=stop,
                          **(settle if whole_workload else {**settle, "min_files": min_files}))


async def stores_landing(plan: Plan, cfg: dict, min_files: int = 0) -> dict | None:
    """``landed_stores`` awaited from a running unit, in a thread: cancelled (the run's Ctrl-C or SIGTERM), the
    thread reads once more and ends rather than holding the process for the backend's store timeout."""
    stop = threading.Event()
    try:
        return await asyncio.to_thread(landed_stores, plan, cfg, min_files=min_files, stop=stop)
    except asyncio.CancelledError:
        stop.set()
        raise


def stores_after_answer(plan: Plan) -> bool:
    """Whether the plan's replicas store to a pool of kvpool's files only after the answer (vllm-fs); not a
    reference replica or an external fleet, which have no pool of kvpool's to wait for."""
    return bool(not plan.external and plan_pool_dirs(plan)
                and pool_backend(Cell.from_name(plan.cell).backend).stores_after_answer)


def drop_pool(plan: Plan, use_proc_drop_caches: bool) -> dict:
    """Evict the plan's pool files from the page cache and verify; a memory pool has none to drop."""
    record = drop_from_page_cache(plan_pool_dirs(plan), use_proc_drop_caches)
    if plan.memory_pool:
        redis = any(server.kind == "redis" for server in plan.servers)
        record.update(memory_backed=True, pool_in="the Redis servers' memory" if redis
                      else "the LMCache server's L1 (host RAM)")
    return record


def reference_phase(plan: Plan, requests: list, cfg: dict, log_dir: Path) -> pd.DataFrame:
    """Greedy answers of ``requests`` (kvpool.measure.reference.Request: a prompt and the split to compute it in)
    from one replica with no pool, started for them and stopped after: the split-matched reference."""
    output_tokens, timeout_s = cfg["workload"]["output_tokens"], cfg["engine"]["request_timeout_s"]

    async def run(url: str) -> list[dict]:
        async with new_session() as session:
            with tqdm(total=len(requests), desc="reference", unit="request") as bar:
                return await split_reference.compute(session, url, requests, output_tokens, timeout_s, bar)

    with timed_fleet(plan, cfg, log_dir) as fleet:
        rows = asyncio.run(run(fleet.replicas[0].url))
    return pd.DataFrame(rows, columns=split_reference.COLUMNS)


async def scrape_serving(session: aiohttp.ClientSession, by_index: dict[int, Replica],
                          serving: list[int]) -> dict[int, dict]:
    """The ``/metrics`` counters of each serving replica now."""
    return {i: await metrics.scrape(session, by_index[i].url) for i in serving}


def counter_window(before: dict[int, dict], after: dict[int, dict], source: str) -> int:
    """Prompt tokens of ``source`` the serving replicas counted between two scrapes."""
    return sum(metrics.delta(after[i], before[i]).get(source, 0) for i in before)


def external_window(before: dict[int, dict], after: dict[int, dict]) -> int:
    """Tokens the serving replicas loaded from the pool between two scrapes, by their own count."""
    return counter_window(before, after, "external_kv_transfer")


def times_window(before: dict[int, dict], after: dict[int, dict]) -> dict[str, dict]:
    """Where the window's requests spent their time, by the serving replicas' own histograms
    (``metrics.TIMINGS``): per part, the requests counted between two scrapes and their mean seconds. With
    many requests in flight no request's own split can be read; the means over the window can, and say
    which part grows with load. A part no replica exports has no entry."""
    found = {}
    for part in metrics.TIMINGS:
        if any(f"{part}_count" in after[i] for i in before):
            count, total = (counter_window(before, after, f"{part}_{kind}") for kind in ("count", "sum"))
            found[part] = {"requests": count, "mean_s": total / count if count else None}
    return found


@dataclasses.dataclass
class TimedFleet:
    """A unit's fleet (and its pool servers) while it runs: the plan as the servers resolved it, the
    replicas, the servers, the measured window (timed, and sampled when named), and what the servers did
    in it (``pool_record``, filled when the servers stop)."""

    plan: Plan
    replicas: list[Replica]
    servers: list
    cfg: dict
    pool_record: dict
    sampler: Sampler | None = None
    started: float | None = None
    finished: float | None = None
    served: dict | None = None

    @property
    def by_index(self) -> dict[int, Replica]:
        return {replica.index: replica for replica in self.replicas}

    @contextmanager
    def window(self, sampled: str | None = None, disks: list[str] | None = None):
        """The unit's measured window: timed, and its drives and power sampled under the name ``sampled``."""
        sampling = phase_sampler(self.plan, sampled, disks or [], self.cfg, self.replicas) if sampled else nullcontext()
        with sampling as sampler:
            self.sampler = sampler
            self.started = time.time()
            try:
                yield self
            finally:
                self.finished = time.time()

    def meta(self, **fields) -> dict:
        """The unit's meta data: ``fields``, the window's times unless ``fields`` time a narrower span (a
        load level's schedule), and the pool servers' record. Read it once the fleet has stopped."""
        meta = {"wall_s": self.finished - self.started, "started_at": self.started, "finished_at": self.finished,
                **fields}
        if self.served is not None:
            meta["served"] = self.served
        if self.pool_record:
            meta["pool_server"] = self.pool_record
        return meta

    def result(self, frame: pd.DataFrame, **fields) -> UnitResult:
        """The unit's records ``frame``, its meta data (``meta(**fields)``) and its window's sampler."""
        return UnitResult(frame, self.meta(**fields), self.sampler)


@contextmanager
def timed_fleet(plan: Plan, cfg: dict, log_dir: Path, servers: list[PoolServer] | None = None,
                replicas: list[Replica] | None = None):
    """Every unit kind's fleet: the plan's pool servers (started here and stopped after, unless
    ``servers`` run already), then the replicas, healthy, as a ``TimedFleet``; everything this started is
    stopped however the unit ends. ``replicas`` that run already (a cell's one fleet from populate through
    its follow-ups, kvpool.studies.study_a.run_cell) are used and left running."""
    with pool_servers(plan, log_dir, cfg, servers, replicas_stop=replicas is None) as (plan, servers, pool_record):
        running = nullcontext(replicas) if replicas is not None else running_fleet(
            plan, log_dir, cfg["engine"]["startup_timeout_s"])
        with running as replicas:
            # what each replica runs by its own word, for the gate to hold against the plan
            yield TimedFleet(plan, replicas, servers, cfg, pool_record,
                             served={str(replica.index): replica.served() for replica in replicas})


def chain_fleet(plan: Plan, cfg: dict, log_dir: Path, body, sampled: tuple[str, list[str]] | None = None,
                after=None) -> UnitResult:
    """Study B's request path, shared by its blocks and the length units, on a ``timed_fleet``:
    ``await body(send, send_together, plan, replicas)``, timed. ``send`` sends one request at a time with
    its serving replica's /metrics deltas, ``send_together`` one among concurrent ones (its hits from the
    response's cached tokens); ``plan`` is the plan as the pool servers resolved it; ``sampled`` (a
    sampler's name and disks) samples the drives and power around the requests. Returns the body's rows
    as ChainRecords, the meta data (wall time, the servers' counters) and the sampler (None unless sampled). ``after``:
    ``await after(session, replicas, rows)`` once the window has closed, before the fleet stops (untimed work
    on the unit's replicas: an OFF block's reference computations)."""
    output_tokens, timeout_s = cfg["workload"]["output_tokens"], cfg["engine"]["request_timeout_s"]
    with timed_fleet(plan, cfg, log_dir) as fleet:
        by_index = fleet.by_index

        async def requests():
            async with new_session() as session:
                async def send(replica: int, prompt: list[int]):
                    # a pool that stores after the answer is waited for by the body, before each step and turn,
                    # and recorded there (kvpool.studies.chain_stores)
                    return await measured_request(session, by_index[replica], prompt, output_tokens, timeout_s,
                                                  token_ids=True)

                async def send_together(replica: int, prompt: list[int]):
                    result = await complete(session, by_index[replica].url, prompt, output_tokens, timeout_s,
                                            token_ids=True)
                    if result.error:
                        result.error = replica_error(by_index[replica], "the request", result.error)
                    return result, {}

                return await body(send, send_together, fleet.plan, fleet.replicas)

        with fleet.window(*(sampled or ())):
            rows = asyncio.run(requests())
        if after is not None:
            asyncio.run(_after(after, fleet.replicas, rows))
    return fleet.result(records.frame(records.ChainRecord, rows))


async def _after(after, replicas: list[Replica], rows: list[dict]) -> None:
    async with new_session() as session:
        await after(session, replicas, rows)


def recording_sends(send, prompts: dict[str, list[int]]):
    """``send`` that also keeps each prompt by its payload's SHA-256, for the reference to compute."""
    async def recorded(replica: int, prompt: list[int]):
        prompts[split_reference.payload_sha256(prompt)] = prompt
        return await send(replica, prompt)

    return recorded
