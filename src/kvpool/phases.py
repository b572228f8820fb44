"""The timed phases: populate the pool, reuse it cross-replica, and a pool-less recompute for reference.

Each phase starts its own fleet and stops it before returning, on success or failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import subprocess
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import aiohttp
import pandas as pd
from tqdm import tqdm

from kvpool import external, metrics, mp
from kvpool import reference as split_reference
from kvpool.client import RequestResult, complete, new_session
from kvpool.fleet import FleetError, PoolServer, Replica, running_fleet, running_servers
from kvpool.plan import plan_gpus, plan_pool_dirs
from kvpool.pool import drop_from_page_cache
from kvpool.reference import followups
from kvpool.routing import followup_route, populate_route
from kvpool.telemetry import Sampler

log = logging.getLogger(__name__)

RECORD_COLUMNS = ["doc_id", "prefill_replica", "serve_replica", "ttft_s", "e2e_s", "prompt_tokens",
                  "cached_tokens", "external_hit_tokens", "local_compute_tokens", "error", "started_at", "output_text",
                  "followup", "local_cache_hit_tokens"]


class PreflightFailed(RuntimeError):
    """Replicas of a shared pool cannot find each other's chunks or get different KV back (or an
    isolated arm finds them)."""


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
        await asyncio.to_thread(_await_exit, replica, 2.0)  # as below: let a dead replica's exit show
        return RequestResult(error=_replica_error(replica, "its /metrics before the request", exc)), {}
    result = await complete(session, replica.url, prompt, output_tokens, timeout_s, cache_salt, token_ids)
    try:
        after = await metrics.scrape(session, replica.url)
    except (aiohttp.ClientError, TimeoutError) as exc:
        # a server that stopped answering has usually just died: give its exit a moment to show
        await asyncio.to_thread(_await_exit, replica, 2.0)
        result.error = _replica_error(replica, "the request" if result.error else "its /metrics after the request",
                                      result.error or exc)
        return result, {}
    if result.error:
        result.error = _replica_error(replica, "the request", result.error)
    return result, metrics.delta(after, before)


def _await_exit(replica: Replica, timeout_s: float) -> None:
    if replica.proc is None:  # an external replica: no process of ours to wait for
        return
    try:
        replica.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass


def _replica_error(replica: Replica, what: str, cause) -> str:
    """A failed request's error, naming the replica, and its exit code and log tail if it died."""
    if replica.alive():
        return f"replica {replica.index}: {what} failed: {cause}"
    return f"{what} failed ({cause}): {replica.died_error()}"


def _record(doc_id: int, prefill: int | None, serve: int, result: RequestResult, counts: dict[str, int]) -> dict:
    row = dataclasses.asdict(result)
    row.update(doc_id=doc_id, prefill_replica=prefill, serve_replica=serve,
               external_hit_tokens=counts.get("external_kv_transfer"),
               local_compute_tokens=counts.get("local_compute"), local_cache_hit_tokens=counts.get("local_cache_hit"))
    return {column: row.get(column) for column in RECORD_COLUMNS}


async def _preflight(session, replicas: list[Replica], probe: list[int], probe_followup: list[int],
                     output_tokens: int, timeout_s: float, expect_shared: bool) -> dict:
    """Replica 0 stores a probe; replica 1 asks for its extension. Shared pools must hit, isolated must not.

    Replica 0 then answers the extension itself, on the probe's KV in its own GPU cache. The pool and
    that cache both cover the probe's two whole chunks, so a shared pool that returned the KV replica 0
    stored gives replica 1 the same greedy tokens; a pool that returns damaged KV is caught here,
    before the populate phase is spent.
    """
    stored = await complete(session, replicas[0].url, probe, output_tokens, timeout_s)
    found, counts = await measured_request(session, replicas[1], probe_followup, output_tokens, timeout_s)
    local = await complete(session, replicas[0].url, probe_followup, output_tokens, timeout_s)
    hits = counts.get("external_kv_transfer", 0)
    errors = [e for e in (stored.error, found.error, local.error) if e]
    outputs_match = not errors and found.output_text == local.output_text
    # Only a pool hit puts the pool's KV under test; an isolated arm's replica 1 computes cold.
    ok = not errors and ((hits > 0 and outputs_match) if expect_shared else hits == 0)
    return {"ok": ok, "expect_shared": expect_shared, "probe_tokens": len(probe), "hit_tokens": hits,
            "outputs_match": outputs_match, "pool_output": found.output_text, "local_output": local.output_text,
            "errors": errors}


def preflight_failure(cell: str, preflight: dict) -> str:
    """Why a preflight failed, in one line."""
    if preflight["errors"]:
        return f"preflight failed for {cell}: a probe request failed: {'; '.join(preflight['errors'])}"
    if preflight["expect_shared"] and preflight["hit_tokens"] > 0 and not preflight.get("outputs_match", True):
        return (f"preflight failed for {cell}: replica 1 loaded {preflight['hit_tokens']} tokens of replica 0's "
                f"probe from the pool but answered {preflight['pool_output']!r}, while replica 0, on the probe's "
                f"KV in its own GPU cache, answered {preflight['local_output']!r}: the pool returned different KV "
                "than was stored (e.g. LMCache's in-process connector on vLLM 0.26, LMCache issue #4463)")
    expected = ("expected a hit: the pool is not shared" if preflight["expect_shared"]
                else "expected none: the arm is not isolated")
    return (f"preflight failed for {cell}: replica 1 loaded {preflight['hit_tokens']} of the "
            f"{preflight['probe_tokens']}-token probe replica 0 stored ({expected})")


async def _populate(replicas, workload, route, cfg, probe, expect_shared: bool) -> tuple[list[dict], dict]:
    output_tokens, timeout_s = cfg["workload"]["output_tokens"], cfg["engine"]["request_timeout_s"]
    async with new_session() as session:
        preflight = await _preflight(session, replicas, *probe, output_tokens, timeout_s, expect_shared=expect_shared)
        log.info("preflight %s: replica 1 loaded %d tokens of the %d-token probe replica 0 stored (%s)",
                 "passed" if preflight["ok"] else "FAILED", preflight["hit_tokens"], preflight["probe_tokens"],
                 "a hit expected" if expect_shared else "none expected")
        if not preflight["ok"] and cfg["preflight_on_failure"] == "abort":
            return [], preflight
        rows: list[dict] = []
        bar = tqdm(total=len(workload), desc="populate", unit="doc")

        async def feed(replica: Replica):
            # One request in flight per replica keeps each replica's counter deltas exact.
            for item in workload:
                if route[item["doc_id"]] != replica.index:
                    continue
                result, counts = await measured_request(session, replica, item["document"], output_tokens, timeout_s)
                rows.append(_record(item["doc_id"], replica.index, replica.index, result, counts))
                bar.update()

        await asyncio.gather(*(feed(r) for r in replicas))
        bar.close()
    return sorted(rows, key=lambda r: r["doc_id"]), preflight


def _sampler(plan: dict, phase: str, disks: list[str], cfg: dict, replicas: list[Replica]) -> Sampler:
    gpus = plan_gpus(plan)
    return Sampler(plan["cell"], phase, disks, cfg["telemetry_hz"],
                   pids=lambda: {r.index: r.proc.pid for r in replicas if r.proc is not None},
                   gpus=gpus or None)


def server_settings(cfg: dict, plan: dict) -> dict:
    """The config section of the plan's pool servers: ``lmcache_redis`` for Redis servers, else ``lmcache_mp``
    (its startup and drain timeouts)."""
    redis = any(server.get("kind") == "redis" for server in plan.get("servers", []))
    if redis:
        return {"drain_timeout_s": 0, **cfg["lmcache_redis"]}
    return cfg["lmcache_mp"]


@contextmanager
def pool_servers(plan: dict, log_dir: Path, cfg: dict, servers: list[PoolServer] | None = None):
    """The cell's LMCache MP servers for one phase, and what they did in it (``record``, filled on exit).

    Servers handed in (a memory pool, which lives only as long as its server) keep running; otherwise
    the phase starts its own and stops them. Before the record is taken, every L2 store a server
    accepted has reached the drive, so a server stopped afterwards loses nothing.
    """
    record: dict = {}
    if not plan.get("servers"):
        yield plan, [], record
        return
    settings = server_settings(cfg, plan)
    if servers is not None:
        planned = [(s["index"], s["port"], s["http_port"]) for s in plan["servers"]]
        serving = [(s.entry["index"], s.entry["port"], s.entry["http_port"]) for s in servers]
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


def populate(plan: dict, workload: list[dict], cfg: dict, probe: tuple[list[int], list[int]], log_dir: Path,
             disks: list[str], servers: list[PoolServer] | None = None, *, expect_shared: bool):
    """Start the fleet (and its pool servers unless ``servers`` run already), run the preflight (replica 1
    must find replica 0's probe when ``expect_shared``, must not otherwise), send each document once
    round robin, stop the fleet.

    Returns the per-document records, the phase's meta data and its telemetry sampler.
    """
    route = populate_route([item["doc_id"] for item in workload], len(plan["replicas"]))
    with pool_servers(plan, log_dir, cfg, servers) as (plan, servers, pool_record):
        with running_fleet(plan, log_dir, cfg["engine"]["startup_timeout_s"]) as replicas:
            # what an external fleet says of itself (kvpool's own replicas are in the plan and manifest)
            endpoints = [external.describe(r.url) for r in replicas] if plan.get("external") else None
            started = time.time()
            with _sampler(plan, "populate", disks, cfg, replicas) as sampler:
                rows, preflight = asyncio.run(_populate(replicas, workload, route, cfg, probe, expect_shared))
            wall_s = time.time() - started
    if not preflight["ok"]:
        message = preflight_failure(plan["cell"], preflight)
        if cfg["preflight_on_failure"] == "abort":
            raise PreflightFailed(message + "; set preflight_on_failure: record to measure the cell anyway")
        log.error(message)
    frame = pd.DataFrame(rows, columns=RECORD_COLUMNS)
    meta = {"preflight": preflight, "wall_s": wall_s, "started_at": started}
    if endpoints is not None:
        meta["endpoints"] = endpoints
    if pool_record:
        meta["pool_server"] = pool_record
    return frame, meta, sampler


async def reset_prefix_cache(session: aiohttp.ClientSession, replica: Replica) -> str:
    """Empty ``replica``'s own prefix cache through vLLM's /reset_prefix_cache (open with
    VLLM_SERVER_DEV_MODE); an error message, or "" when vLLM reports success. The next request's
    local-cache-hit counter delta proves it."""
    try:
        async with session.post(f"{replica.url}/reset_prefix_cache",
                                timeout=aiohttp.ClientTimeout(total=60)) as response:
            body = await response.text()
            if response.status != 200:
                return f"replica {replica.index}: /reset_prefix_cache answered HTTP {response.status}: {body[:200]}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return _replica_error(replica, "/reset_prefix_cache", exc)
    # vLLM answers {"success": false} while blocks are still held; older versions answer with no body
    if body.strip().startswith("{") and not json.loads(body).get("success", True):
        return f"replica {replica.index}: /reset_prefix_cache reported no success (blocks still held)"
    return ""


async def _reuse(replicas, workload, route, prefill, cfg, between_reloads=None) -> tuple[list[dict], float, float]:
    output_tokens, timeout_s = cfg["workload"]["output_tokens"], cfg["engine"]["request_timeout_s"]
    by_index = {r.index: r for r in replicas}
    rows = []
    async with new_session() as session:
        started = time.time()
        with tqdm(total=sum(len(followups(item)) for item in workload), desc="reuse", unit="follow-up") as bar:
            for item in workload:
                serve = by_index[route[item["doc_id"]]]
                for number, prompt in enumerate(followups(item)):
                    reset = ""
                    if number:  # a reload again: nothing of the document left in the serving replica or warm
                        reset = await reset_prefix_cache(session, serve)
                        if between_reloads is not None:
                            await asyncio.to_thread(between_reloads)
                    result, counts = await measured_request(session, serve, prompt, output_tokens, timeout_s)
                    if reset and not result.error:
                        result.error = f"the prefix cache reset before this follow-up failed: {reset}"
                    row = _record(item["doc_id"], prefill[item["doc_id"]], serve.index, result, counts)
                    rows.append({**row, "followup": number})
                    bar.update()
        finished = time.time()
    return rows, started, finished


def drop_pool(plan: dict, use_proc_drop_caches: bool) -> dict:
    """Evict the plan's pool files from the page cache and verify; a memory pool has none to drop."""
    record = drop_from_page_cache(plan_pool_dirs(plan), use_proc_drop_caches)
    if plan.get("memory_pool"):
        redis = any(server.get("kind") == "redis" for server in plan["servers"])
        record.update(memory_backed=True, pool_in="the Redis servers' memory" if redis
                      else "the LMCache server's L1 (host RAM)")
    return record


def reuse(plan: dict, workload: list[dict], prefill: dict[int, int], cfg: dict, log_dir: Path, disks: list[str],
          servers: list[PoolServer] | None = None, between_reloads=None):
    """Start the fleet on the populated pool (an MP pool on a drive: a fresh server, its L1 empty),
    drop the pool from the page cache again, send every follow-up to a replica that did not prefill
    its document, one at a time, and stop the fleet. Before each of a document's later follow-ups the
    serving replica's prefix cache is emptied and ``between_reloads`` runs (a pool of files restored
    and dropped again)."""
    route = followup_route(prefill, len(plan["replicas"]))
    with pool_servers(plan, log_dir, cfg, servers) as (plan, servers, pool_record):
        with running_fleet(plan, log_dir, cfg["engine"]["startup_timeout_s"]) as replicas:
            # Starting the fleet may have touched the pool; the drop must hold right before the reads.
            drop = drop_pool(plan, cfg["drop_caches"])
            with _sampler(plan, "reuse", disks, cfg, replicas) as sampler:
                rows, started, finished = asyncio.run(_reuse(replicas, workload, route, prefill, cfg,
                                                             between_reloads))
    frame = pd.DataFrame(rows, columns=RECORD_COLUMNS)
    meta = {"drop_before_reuse": drop, "wall_s": finished - started, "started_at": started, "finished_at": finished}
    if pool_record:
        meta["pool_server"] = pool_record
    return frame, meta, sampler


def reference(plan: dict, requests: list, cfg: dict, log_dir: Path) -> pd.DataFrame:
    """Greedy answers of ``requests`` (kvpool.reference.Request: a prompt and the split to compute it in)
    from one replica with no pool, started for them and stopped after: the split-matched reference."""
    output_tokens, timeout_s = cfg["workload"]["output_tokens"], cfg["engine"]["request_timeout_s"]

    async def run(url: str) -> list[dict]:
        async with new_session() as session:
            with tqdm(total=len(requests), desc="reference", unit="request") as bar:
                return await split_reference.compute(session, url, requests, output_tokens, timeout_s, bar)

    with running_fleet(plan, log_dir, cfg["engine"]["startup_timeout_s"]) as replicas:
        rows = asyncio.run(run(replicas[0].url))
    return pd.DataFrame(rows, columns=split_reference.COLUMNS)


LOAD_COLUMNS = [*RECORD_COLUMNS, "level", "due_s"]


async def _scrape_serving(session: aiohttp.ClientSession, by_index: dict[int, Replica],
                          serving: list[int]) -> dict[int, dict]:
    """The ``/metrics`` counters of each serving replica now."""
    return {i: await metrics.scrape(session, by_index[i].url) for i in serving}


def _window(before: dict[int, dict], after: dict[int, dict], source: str) -> int:
    """Prompt tokens of ``source`` the serving replicas counted between two scrapes."""
    return sum(metrics.delta(after[i], before[i]).get(source, 0) for i in before)


def _window_external(before: dict[int, dict], after: dict[int, dict]) -> int:
    """Tokens the serving replicas loaded from the pool between two scrapes, by their own count."""
    return _window(before, after, "external_kv_transfer")


async def _load(replicas, workload, route, prefill, cfg, level) -> tuple[list[dict], float, float, int | None]:
    from kvpool.load import send_level

    # a closed-loop level has no arrivals to draw and keeps its own N in flight
    load = cfg["load"] if level.kind == "rate" else {"max_in_flight": int(level.value), "burstiness": 1.0, "seed": 0}
    output_tokens, timeout_s = cfg["workload"]["output_tokens"], cfg["engine"]["request_timeout_s"]
    by_index = {r.index: r for r in replicas}
    serving = sorted({route[item["doc_id"]] for item in workload})
    requests = [(item["doc_id"], by_index[route[item["doc_id"]]].url, item["followup"]) for item in workload]
    async with new_session() as session:
        before = await _scrape_serving(session, by_index, serving)
        started = time.time()
        sent = await send_level(session, level, requests, output_tokens, timeout_s, load["max_in_flight"],
                                load["burstiness"], load["seed"])
        finished = time.time()
        try:
            window = _window_external(before, await _scrape_serving(session, by_index, serving))
        except (aiohttp.ClientError, TimeoutError):
            window = None
    rows = []
    for doc_id, due, result in sent:
        serve = by_index[route[doc_id]]
        if result.error:
            result.error = _replica_error(serve, "the request", result.error)
        # a serving replica that never held the document: every cached token came from the pool
        hits = {"external_kv_transfer": result.cached_tokens,
                "local_compute": None if result.prompt_tokens is None or result.cached_tokens is None
                else result.prompt_tokens - result.cached_tokens}
        rows.append({**_record(doc_id, prefill[doc_id], serve.index, result, hits), "level": level.name,
                     "due_s": due})
    return rows, started, finished, window


def _peer(plan: dict, replicas: list[Replica], workload: list[dict], route: dict[int, int],
          prefill: dict[int, int], cfg: dict, log_dir: Path, out_dir: Path) -> tuple:
    """The peer replay (kvpool.peer): per serving replica, ``vllm bench serve`` sends its follow-ups
    one at a time from a custom dataset of their exact token ids as text; the hits are the serving
    replicas' /metrics deltas over the whole window."""
    import os

    from transformers import AutoTokenizer

    from kvpool import peer
    from kvpool.plan import BASE_ENV, SERVED_MODEL_NAME

    output_tokens = cfg["workload"]["output_tokens"]
    tokenizer = AutoTokenizer.from_pretrained(plan["model"])
    by_index = {r.index: r for r in replicas}
    serving = sorted({route[item["doc_id"]] for item in workload})
    bench_dir = log_dir.parent / "vllm-bench"  # log_dir holds the replicas' logs
    bench_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **BASE_ENV}

    async def scrape_all() -> dict[int, dict]:
        async with new_session() as session:
            return await _scrape_serving(session, by_index, serving)

    rows, commands = [], []
    before = asyncio.run(scrape_all())
    started = time.time()
    for index in serving:
        items = [item for item in workload if route[item["doc_id"]] == index]
        dataset = bench_dir / f"replica-{index}.jsonl"
        peer.write_dataset(dataset, peer.dataset([item["followup"] for item in items], tokenizer, output_tokens))
        result_name = f"vllm-bench-replica-{index}.json"
        args = peer.bench_args(by_index[index].url, SERVED_MODEL_NAME, plan["model"], dataset, len(items),
                               output_tokens, out_dir, result_name)
        commands.append("vllm bench serve " + " ".join(args))
        log.info("vllm bench serve: %d follow-ups to replica %d", len(items), index)
        peer.run_bench(args, bench_dir / f"replica-{index}.log", cfg["peer"]["timeout_s"], env)
        result = peer.read_result(out_dir / result_name, len(items))
        rows += [{**row, "level": "peer", "due_s": 0.0}
                 for row in peer.rows(result, [item["doc_id"] for item in items], prefill, index)]
    finished = time.time()
    try:
        window = _window_external(before, asyncio.run(scrape_all()))
    except (aiohttp.ClientError, TimeoutError):
        window = None
    return rows, started, finished, window, commands


def load_level(plan: dict, workload: list[dict], prefill: dict[int, int], cfg: dict, log_dir: Path,
               disks: list[str], level, servers: list[PoolServer] | None = None, out_dir: Path | None = None):
    """One load level: a fresh fleet on the restored pool, the drop checked again right before the
    first request, every follow-up to a replica that did not prefill its document, sent at ``level``
    (the ``peer`` level: by vLLM's own client, its files in ``out_dir``). An lmcache-mp cell's level
    starts fresh servers on the restored L2 folder, as its reuse does, unless ``servers`` (a memory
    pool's, re-populated for the level) run already."""
    route = followup_route(prefill, len(plan["replicas"]))
    commands = None
    with pool_servers(plan, log_dir, cfg, servers) as (plan, _, pool_record):
        with running_fleet(plan, log_dir, cfg["engine"]["startup_timeout_s"]) as replicas:
            drop = drop_pool(plan, cfg["drop_caches"])
            with _sampler(plan, f"load~{level.name}", disks, cfg, replicas) as sampler:
                if level.kind == "peer":
                    rows, started, finished, window, commands = _peer(plan, replicas, workload, route, prefill, cfg,
                                                                      log_dir, out_dir)
                else:
                    rows, started, finished, window = asyncio.run(_load(replicas, workload, route, prefill, cfg,
                                                                        level))
    frame = pd.DataFrame(rows, columns=LOAD_COLUMNS)
    meta = {"level": level.name, "drop_before_level": drop, "wall_s": finished - started, "started_at": started,
            "finished_at": finished, "window_external_tokens": window}
    if commands is not None:
        meta["commands"] = commands
    if pool_record:
        meta["pool_server"] = pool_record
    return frame, meta, sampler


def _chain_fleet(plan: dict, cfg: dict, log_dir: Path, body, sampled: tuple[str, list[str]] | None = None):
    """Study B's request path, shared by its blocks and the length units: the plan's pool servers if
    any and a fresh fleet, then ``await body(send, send_together, plan, replicas)``, timed, everything
    stopped after. ``send`` sends one request at a time with its serving replica's /metrics deltas,
    ``send_together`` one among concurrent ones (its hits from the response's cached tokens); ``plan``
    is the plan as the pool servers resolved it; ``sampled`` (a sampler's name and disks) samples the
    drives and power around the requests. Returns the body's rows, the meta data (wall time, the
    servers' counters) and the sampler (None unless sampled)."""
    output_tokens, timeout_s = cfg["workload"]["output_tokens"], cfg["engine"]["request_timeout_s"]
    with pool_servers(plan, log_dir, cfg) as (plan, _, pool_record):
        with running_fleet(plan, log_dir, cfg["engine"]["startup_timeout_s"]) as replicas:
            by_index = {r.index: r for r in replicas}

            async def requests():
                async with new_session() as session:
                    async def send(replica: int, prompt: list[int]):
                        return await measured_request(session, by_index[replica], prompt, output_tokens, timeout_s,
                                                      token_ids=True)

                    async def send_together(replica: int, prompt: list[int]):
                        result = await complete(session, by_index[replica].url, prompt, output_tokens, timeout_s,
                                                token_ids=True)
                        if result.error:
                            result.error = _replica_error(by_index[replica], "the request", result.error)
                        return result, {}

                    return await body(send, send_together, plan, replicas)

            with (_sampler(plan, sampled[0], sampled[1], cfg, replicas) if sampled else nullcontext()) as sampler:
                started = time.time()
                rows = asyncio.run(requests())
                finished = time.time()
    meta = {"started_at": started, "finished_at": finished, "wall_s": finished - started}
    if pool_record:
        meta["pool_server"] = pool_record
    return rows, meta, sampler


def studyb_block(plan: dict, block: str, workload: dict, study: dict, cfg: dict, log_dir: Path) -> tuple:
    """One of Study B's blocks (kvpool.studyb) on a fresh fleet and pool (_chain_fleet). Returns the
    rows and the block's meta data (wall time, the servers' counters, what fault injection corrupted)."""
    from kvpool.pool import corrupt, pool_files
    from kvpool.studyb import run_block

    injected, before, prompts = [], set(), {}
    fault = cfg.get("fault_injection", {}).get("corrupt_stored_chunk") and any(r["pool_dir"] for r in plan["replicas"])

    async def body(send, send_together, plan, replicas):
        send, send_together = _recording(send, prompts), _recording(send_together, prompts)

        def corrupt_first_chunk(step: str) -> None:
            """Fault injection: the first chunk file the chain's cold step stored, before the cross step."""
            files = pool_files(plan_pool_dirs(plan))
            if step == "cold":
                before.clear()
                before.update(files)
            elif step == "cross":
                stored = [f for f in files if f not in before]
                if stored:
                    injected.append(corrupt(min(stored, key=lambda f: f.stat().st_mtime_ns)))
                    log.warning("fault injection: corrupted %s", injected[-1]["file"])

        return await run_block(send, block, workload, study, len(replicas), corrupt_first_chunk if fault else None,
                               send_together)

    rows, meta, _ = _chain_fleet(plan, cfg, log_dir, body)
    meta = {"block": block, **meta}
    if fault:
        meta["fault_injection"] = injected
    return rows, meta, prompts


def _recording(send, prompts: dict[str, list[int]]):
    """``send`` that also keeps each prompt by its payload's SHA-256, for the reference to compute."""
    async def recorded(replica: int, prompt: list[int]):
        prompts[split_reference.payload_sha256(prompt)] = prompt
        return await send(replica, prompt)

    return recorded


def context_unit(plan: dict, workload: dict, study: dict, cfg: dict, log_dir: Path, disks: list[str]):
    """A context unit (kvpool.contexts): each document's locality chain one request at a time on a fresh
    fleet and pool (_chain_fleet), the pool dropped from the page cache and checked right before every
    cross-replica step, so each reload is a device read."""
    from kvpool.contexts import BLOCK
    from kvpool.studyb import COLUMNS, run_block

    drops, prompts = [], {}

    async def body(send, _send_together, plan, replicas):
        send = _recording(send, prompts)

        def before(step: str) -> None:
            if step == "cross":
                drops.append(drop_pool(plan, cfg["drop_caches"]))

        return await run_block(send, BLOCK, workload, study, len(replicas), before)

    rows, meta, sampler = _chain_fleet(plan, cfg, log_dir, body, sampled=("contexts", disks))
    return pd.DataFrame(rows, columns=COLUMNS), {"drops_before_cross": drops, "prompts": prompts, **meta}, sampler


def _routed_row(router: str, phase: str, seq: int, doc_id: int, first: int | None, serve: Replica, seen: bool,
                result: RequestResult, counts: dict[str, int] | None) -> dict:
    counts = counts or {}
    row = _record(doc_id, first, serve.index, result, counts)
    row.update(router=router, phase=phase, seq=seq, first_replica=row.pop("prefill_replica"), seen_before=seen,
               local_cache_hit_tokens=counts.get("local_cache_hit"))
    return row


async def _routed_one_at_a_time(by_index: dict[int, Replica], router, phase: str, sends: list[tuple[int, list[int]]],
                                tokens: dict[int, list[int]], seen: dict[int, set[int]], cfg: dict) -> list[dict]:
    """Requests ``sends`` (doc_id, prompt) one at a time, each where the router sends it, with the serving
    replica's counter deltas around it."""
    output_tokens, timeout_s = cfg["workload"]["output_tokens"], cfg["engine"]["request_timeout_s"]
    rows = []
    async with new_session() as session:
        for seq, (doc_id, prompt) in enumerate(tqdm(sends, desc=f"{router.name} {phase}", unit="request")):
            place = router.first if phase == "first" else router.followup
            index = place(doc_id, tokens[doc_id])
            result, counts = await measured_request(session, by_index[index], prompt, output_tokens, timeout_s)
            rows.append(_routed_row(router.name, phase, seq, doc_id, router.placed.get(doc_id), by_index[index],
                                    index in seen[doc_id], result, counts))
            seen[doc_id].add(index)
    return rows


async def _routed_hot(by_index: dict[int, Replica], router, sends: list[tuple[int, list[int]]],
                      tokens: dict[int, list[int]], seen: dict[int, set[int]], cfg: dict, in_flight: int):
    """The hot phase: ``in_flight`` requests at a time; per request only its response's ``cached_tokens``
    (own cache and pool together), the split by source from the serving replicas' counters over the phase."""
    from kvpool import routers
    from kvpool.load import Level, send_level

    output_tokens, timeout_s = cfg["workload"]["output_tokens"], cfg["engine"]["request_timeout_s"]
    placed = [(doc_id, router.followup(doc_id, tokens[doc_id]), prompt) for doc_id, prompt in sends]
    seen_then = []
    for doc_id, index, _ in placed:  # in send order: a hot document's second request finds its first
        seen_then.append(index in seen[doc_id])
        seen[doc_id].add(index)
    serving = sorted({index for _, index, _ in placed})
    async with new_session() as session:
        before = await _scrape_serving(session, by_index, serving)
        sent = await send_level(session, Level("concurrency", in_flight),
                                [(doc_id, by_index[index].url, prompt) for doc_id, index, prompt in placed],
                                output_tokens, timeout_s, in_flight, 1.0, 0)
        after = await _scrape_serving(session, by_index, serving)
    window = {source: _window(before, after, source) for source in routers.SOURCES}
    rows = [_routed_row(router.name, "hot", seq, doc_id, router.placed.get(doc_id), by_index[index], was_seen, result,
                        None)
            for seq, ((doc_id, index, _), was_seen, (_, _, result)) in enumerate(zip(placed, seen_then, sent,
                                                                                       strict=True))]
    return rows, window


def router_unit(plan: dict, workload: list[dict], router_name: str, cfg: dict, log_dir: Path, disks: list[str]):
    """A router unit (kvpool.routers): one fleet on a fresh pool; each document's first request, the
    pool dropped from the page cache and checked, every follow-up, the hot phase, then a replica stopped
    and every follow-up again, each request where ``router_name`` sends it."""
    from collections import defaultdict

    from kvpool import routers

    settings = cfg["routers"]
    tokens = {item["doc_id"]: item["document"] for item in workload}
    followups = {item["doc_id"]: item["followup"] for item in workload}
    doc_ids = [item["doc_id"] for item in workload]
    seen: dict[int, set[int]] = defaultdict(set)
    windows, loss = {}, None
    with pool_servers(plan, log_dir, cfg) as (plan, _, pool_record):
        with running_fleet(plan, log_dir, cfg["engine"]["startup_timeout_s"]) as replicas:
            by_index = {r.index: r for r in replicas}
            router = routers.Router(router_name, sorted(by_index), settings["seed"])
            with _sampler(plan, f"router~{router_name}", disks, cfg, replicas) as sampler:
                started = time.time()
                rows = asyncio.run(_routed_one_at_a_time(by_index, router, "first",
                                                         [(d, tokens[d]) for d in doc_ids], tokens, seen, cfg))
                drop = drop_pool(plan, cfg["drop_caches"])
                order = routers.followup_order(doc_ids, settings["seed"])
                rows += asyncio.run(_routed_one_at_a_time(by_index, router, "follow-up",
                                                          [(d, followups[d]) for d in order], tokens, seen, cfg))
                hot = settings["hot"]
                if hot["requests"]:
                    draws = routers.hot_draws(doc_ids, hot["requests"], hot["zipf_exponent"], settings["seed"])
                    hot_rows, windows["hot"] = asyncio.run(_routed_hot(
                        by_index, router, [(d, followups[d]) for d in draws], tokens, seen, cfg, hot["concurrency"]))
                    rows += hot_rows
                if settings["lose_replica"]:
                    lost = replicas[-1]
                    lost.stop()
                    loss = {"replica": lost.index, "stopped": not lost.alive(), "at": time.time()}
                    log.info("%s: replica %d stopped; %s routes around it", plan["cell"], lost.index, router_name)
                    router.lose(lost.index)
                    order = routers.followup_order(doc_ids, settings["seed"] + 1)
                    rows += asyncio.run(_routed_one_at_a_time(by_index, router, "after-loss",
                                                              [(d, followups[d]) for d in order], tokens, seen, cfg))
                finished = time.time()
    frame = pd.DataFrame(rows).reindex(columns=routers.COLUMNS)
    meta = {"router": router_name, "drop_before_followups": drop, "windows": windows, "loss": loss,
            "wall_s": finished - started, "started_at": started, "finished_at": finished}
    if pool_record:
        meta["pool_server"] = pool_record
    return frame, meta, sampler
