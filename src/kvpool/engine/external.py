"""An external fleet (``fleet.mode: external``): replicas someone else deployed, measured as they are.

kvpool starts and stops none of them. What it can see of them (served models, vLLM version, cache
settings) is recorded; what it cannot verify (cold reads of a pool it cannot see, outputs without a
recompute replica) is listed as not verified in validity.json rather than passed.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvpool.engine.backends import configured

MODE = "external"
# What restores or restarts a fleet between units, which kvpool cannot do to a deployed one.
LAUNCH_ONLY = {
    "load.concurrency": lambda config: any(n != 1 for n in config["load"]["concurrency"]),
    "load.rates": lambda config: bool(config["load"]["rates"]),
    "peer.enabled": lambda config: config["peer"]["enabled"],
    "study_b.enabled": lambda config: config["study_b"]["enabled"],
    "routers.names": lambda config: bool(config["routers"]["names"]),
    "contexts.doc_tokens": lambda config: bool(config["contexts"]["doc_tokens"]),
    "fault_injection.corrupt_stored_chunk": lambda config: config["fault_injection"]["corrupt_stored_chunk"],
}


def is_external(config: dict) -> bool:
    """Whether ``config`` measures an external fleet (a step's settings without ``fleet`` never do)."""
    return config.get("fleet", {}).get("mode") == MODE


def endpoint(url: str) -> tuple[str, int]:
    """Host and port of a replica's base URL (http://host:port)."""
    parsed = urllib.parse.urlsplit(url)
    return parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)


def url_problem(url: str) -> str | None:
    """Why ``url`` is not a replica's base URL (http[s]://host:port), or None."""
    try:
        parsed = urllib.parse.urlsplit(url)
        parsed.port  # noqa: B018 (reading it checks it: out of range or not a number raises)
    except ValueError as exc:
        return f"{url!r} is not a URL ({exc})"
    if parsed.scheme not in ("http", "https"):
        return f"{url!r} is not an http:// or https:// URL"
    if not parsed.hostname:
        return f"{url!r} names no host"
    return None


def same_server(url: str) -> tuple[str, int]:
    """The server a valid base URL reaches, as (address, port): ``localhost`` is the loopback address and an
    IP address is written one way, so two spellings of one server compare equal (no name is looked up)."""
    import ipaddress

    host, port = endpoint(url)
    host = "127.0.0.1" if host == "localhost" else host.lower()
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        pass
    return host, port


def problems(config: dict) -> list[str]:
    """Why an external fleet's config cannot run, each naming the key; empty in launch mode."""
    fleet = config["fleet"]
    if not is_external(config):
        given = [key for key in ("endpoints", "pool_dirs") if fleet[key]]
        return [f"fleet.{key} is set but fleet.mode is launch: kvpool would start its own replicas and ignore it; "
                "set fleet.mode: external" for key in given]
    found = []
    for arm in config["arms"]:
        urls = fleet["endpoints"].get(arm)
        if not urls:
            found.append(f"fleet.endpoints.{arm}: an external fleet needs its {config['replicas']} replicas' URLs "
                         f"for every arm in arms ({', '.join(config['arms'])})")
        elif bad := [problem for url in urls if (problem := url_problem(url))]:
            found += [f"fleet.endpoints.{arm}: {problem}" for problem in bad]
        elif len(urls) != config["replicas"]:
            found.append(f"fleet.endpoints.{arm} lists {len(urls)} URLs for {config['replicas']} replicas")
        elif len({same_server(url) for url in urls}) != len(urls):
            found.append(f"fleet.endpoints.{arm} lists one server twice ({', '.join(urls)}): a follow-up could land "
                         "on its prefiller")
        dirs = fleet["pool_dirs"].get(arm)
        if dirs is not None and len(dirs) != config["replicas"]:
            found.append(f"fleet.pool_dirs.{arm} lists {len(dirs)} directories for {config['replicas']} replicas")
        # kvpool reads, drops from the page cache and hashes every file under a pool folder
        for root in sorted({folder for folder in dirs or [] if os.path.normpath(folder) in ("/", "//")}):
            found.append(f"fleet.pool_dirs.{arm}: {root!r} is the filesystem's root, not a pool folder: kvpool reads "
                         "and hashes every file under it; give the folder the fleet's replicas keep their pool in")
    for arm in set(fleet["endpoints"]) - set(config["arms"]):
        found.append(f"fleet.endpoints.{arm}: {arm} is not in arms ({', '.join(config['arms'])})")
    if len(config["backends"]) != 1 or len(config["chunk_sizes"]) != 1:
        found.append("an external fleet runs one backend at one chunk size (it cannot be reconfigured): "
                     f"backends lists {config['backends']}, chunk_sizes {config['chunk_sizes']}; give the fleet's own")
    if served := [pool.name for pool in configured(config) if pool.server_kind is not None]:
        found.append(f"backends: {served[0]} is a pool of servers that kvpool starts per cell; an external fleet's "
                     "cells are measured on pools its replicas reach themselves (lmcache-fs, lmcache-local-disk, "
                     "vllm-fs)")
    if len(config["tiers"]) != 1:
        found.append(f"an external fleet's pool is on one tier; tiers lists {len(config['tiers'])}")
    for key, used in LAUNCH_ONLY.items():
        if used(config):
            found.append(f"{key}: needs kvpool to restore the pool or restart the fleet between units, which it "
                         "cannot do to an external fleet; turn it off (fleet.mode: external)")
    return found


def not_verified(config: dict, arm: str) -> dict[str, str]:
    """The gate's checks an external fleet's cell cannot make, each with why (empty in launch mode):
    validity.json lists them apart, neither passed nor failed."""
    if not is_external(config):
        return {}
    found = {"pool_writes": "an external replica's log is not kvpool's to read: a failed store shows only as "
                            "missed hits (pool_hits)"}
    if not config["fleet"]["pool_dirs"].get(arm):
        unseen = f"fleet.pool_dirs.{arm} is not set: the external fleet's pool is not visible here"
        found.update(pool_bytes=f"{unseen}, so its size was not measured",
                     cold_reads=f"{unseen}, so its files were not dropped from the page cache before reuse",
                     pool_unchanged=f"{unseen}, so its chunks were not hashed after populate and reuse",
                     populate_stored_in_own_pool=f"{unseen}, so what populate stored in it was not counted")
    if not config["fleet"]["reference"]:
        found["output_matches_recompute"] = "fleet.reference is false: no recompute replica ran here"
    return found


def needs_reference(config: dict) -> bool:
    """Whether the cells' gate compares outputs with kvpool's own recompute replica."""
    return not is_external(config) or config["fleet"]["reference"]


def visible_pool_dirs(config: dict, arm: str) -> list[str | None]:
    """Per replica, the directory of its pool as this machine sees it, or None."""
    dirs = config["fleet"]["pool_dirs"].get(arm)
    return [str(Path(d).resolve()) for d in dirs] if dirs else [None] * config["replicas"]


def _get(url: str, timeout_s: float = 10) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read() if response.status == 200 else None
    except (urllib.error.URLError, OSError):
        return None


def describe(url: str) -> dict:
    """What a running replica says of itself: vLLM's version (/version), the models it serves
    (/v1/models, with their root and max_model_len) and its cache settings (the cache_config_info
    gauge of /metrics). vLLM exposes no KV connector settings; that is said, not guessed."""
    version = _get(f"{url}/version")
    models = _get(f"{url}/v1/models")
    page = _get(f"{url}/metrics")
    cache = None
    if page is not None:
        for family in text_string_to_metric_families(page.decode()):
            if family.name.startswith("vllm:cache_config_info"):
                cache = dict(family.samples[0].labels) if family.samples else None
    return {
        "url": url,
        "vllm_version": json.loads(version).get("version") if version else None,
        "models": [{key: m.get(key) for key in ("id", "root", "max_model_len")}
                   for m in json.loads(models).get("data", [])] if models else None,
        "cache_config": cache,
        "kv_connector": "not exposed by vLLM's API",
    }
