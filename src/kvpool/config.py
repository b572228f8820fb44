"""Checks on a schema-valid config that JSON Schema cannot express, run before any job starts.

The top floor of the package: it gathers every study's own checks (``capacity.problems``,
``contexts.problems``, ``peer.problems``, ``studyb_pool.problems`` over ``studyb.resolved``, the engine's
backends') with the matrix's, so it may import anything and nothing imports it but the workflow."""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
from pathlib import Path

import yaml

from kvpool.cells import Arm, pool_dirs, run_pools, tier_root
from kvpool.engine import external, host_memory, pool_url, shapes
from kvpool.engine.backends import configured, pool_backend
from kvpool.engine.hosts import is_loopback
from kvpool.engine.model import engine_pool_bytes_per_token
from kvpool.engine.owned import OWNED_LMCACHE_KEYS
from kvpool.engine.plan import BASE_ENV
from kvpool.matrix import cells, is_memory_pool
from kvpool.studies import capacity, contexts, peer, studyb_pool, trace_replay
from kvpool.studies.load import LEVEL_PATTERN, Level

# What kvpool sets itself, per replica or per server: set elsewhere, a cell would silently run with
# another value than its plan and folder name say (a chunk~256 cell at 512, a replica on another port).
# These exact spellings are refused while parsing, so a dry run names them; the launch_check rule then
# decides with vLLM's and LMCache's own parsers (kvpool.engine.owned), which also read abbreviations,
# underscores and LMCache's old key names.
OWNED_ENGINE_FLAGS = {"--model", "--host", "--port", "--served-model-name", "--dtype", "--max-model-len",
                      "--kv-transfer-config", "--gpu-memory-utilization", "--enable-prefix-caching",
                      "--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--kv-cache-dtype",
                      "--quantization", "--load-format", "--model-loader-extra-config", "--language-model-only"}
# Environment variables kvpool sets per replica (kvpool.engine.plan.replica_env), each with the config key
# that decides it: the LMCache config file, the hash seed that keys agree on, the replica's core and GPU,
# the batch-invariant kernels, the dev endpoints a unit that empties a replica's cache opens, and the base
# every replica gets (no hub, no telemetry). LMCache also reads every key of its config as LMCACHE_<KEY>
# over its file (lmcache.v1.config), so LMCACHE_<an owned key> is owned too.
KVPOOL_DECIDES = "kvpool sets it where a unit needs it: remove it"
OWNED_ENV = {"LMCACHE_CONFIG_FILE": "use chunk_sizes, backends, tiers and lmcache", "PYTHONHASHSEED": "use hash_keys",
             "VLLM_CPU_OMP_THREADS_BIND": "use engine.cores", "CUDA_VISIBLE_DEVICES": "use engine.gpus",
             "CUDA_DEVICE_ORDER": "use engine.gpus", "VLLM_BATCH_INVARIANT": "use engine.batch_invariant",
             "VLLM_SERVER_DEV_MODE": KVPOOL_DECIDES,
             **dict.fromkeys(BASE_ENV, KVPOOL_DECIDES),
             **{f"LMCACHE_{key.upper()}": "LMCache reads it over the replica's config file; use chunk_sizes, "
                "backends, tiers and hash_keys" for key in OWNED_LMCACHE_KEYS}}
OWNED_SERVER_FLAGS = {"--host", "--port", "--http-host", "--http-port", "--chunk-size", "--l1-size-gb",
                      "--eviction-policy", "--l2-adapter", "--max-gpu-workers", "--max-workers"}


SCHEMA = Path("workflow", "schemas", "config.schema.yaml")  # in the repository


def resolve_extends(config: dict, repo: Path, files: list = ()) -> None:
    """Resolve ``extends`` in place: the named config file (a path in this repository, or absolute) is
    the base, itself resolved first, and ``config`` is merged over it as Snakemake merges config files
    (mappings key by key, anything else replaced). A tier set to null is dropped, so an overlay can
    remove one of its base's tiers. Refuses a missing base and a cycle, naming the files, and an overlay
    that is not the first of ``files`` (the --configfile files ``config`` was merged from). The resolved
    config keeps ``extends`` as the first base named, for its provenance."""
    from snakemake.utils import update_config  # here: kvpool.config also loads where Snakemake is not installed

    merged, first, seen = dict(config), config.get("extends"), []
    while merged.get("extends"):
        name = merged.pop("extends")
        if not isinstance(name, str):
            raise ValueError(f"extends: {name!r} is not a file name; give one config file, e.g. extends: "
                             "config/config.yaml")
        path = Path(name) if Path(name).is_absolute() else repo / name
        if not path.is_file():
            raise ValueError(f"extends: {name} is not a config file (looked for {path})")
        if path.resolve() in seen:
            raise ValueError("extends: a cycle: " + " -> ".join(str(p) for p in [*seen, path.resolve()]))
        seen.append(path.resolve())
        try:
            base = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:  # the parser's report names neither the file nor the key that led to it
            mark = getattr(error, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            raise ValueError(f"extends: {name} is not YAML{where}: {getattr(error, 'problem', None) or error}; "
                             "give a config file") from None
        if not isinstance(base, dict):
            raise ValueError(f"extends: {name} holds a YAML {type(base).__name__}, not a config (a mapping of keys)")
        update_config(base, merged)  # the overlay over its base; the base's own extends is next
        merged = base
    _refuse_a_later_overlay([Path(file) for file in files])  # once its bases are known to be configs
    if first:
        merged["extends"] = first
    if isinstance(merged.get("tiers"), dict):
        merged["tiers"] = {tier: path for tier, path in merged["tiers"].items() if path is not None}
    config.clear()
    config.update(merged)


def _refuse_a_later_overlay(files: list[Path]) -> None:
    """Snakemake merges the --configfile files before ``extends`` is read, so the files before an overlay are
    merged over its base, not under it: ``config/config.yaml`` before ``config/capacity.yaml`` would turn the
    Redis capacity run into the default's pool of files on both tiers, without a word."""
    for later in files[1:]:
        overlay = yaml.safe_load(later.read_text()) or {}
        if isinstance(overlay, dict) and overlay.get("extends"):
            before = sorted({key for file in files[:files.index(later)]
                             for key in (yaml.safe_load(file.read_text()) or {}) if key != "extends"})
            raise ValueError(f"extends: {later} names its base {overlay['extends']}, but --configfile gives "
                             f"{', '.join(map(str, files[:files.index(later)]))} before it, whose keys ("
                             f"{', '.join(before[:6])}{', ...' if len(before) > 6 else ''}) would replace the "
                             f"base's; give {later} first, or alone (its base is the rest of its config)")


def validated(config: dict, repo: Path) -> None:
    """``config`` checked against the schema and its defaults filled in, as the Snakefile reads it. A refusal
    is one line naming the key and its value: JSON Schema's own report spans a dozen lines, and it takes
    3.0 for an integer, which would name a folder chunk~256.0 or fail deep in a study's arithmetic."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    schema = yaml.safe_load((repo / SCHEMA).read_text())
    try:
        validate(config, str(repo / SCHEMA))
    except WorkflowError:
        error = best_match(Draft202012Validator(schema).iter_errors(config))
        if error is None:
            raise
        raise ValueError(f"{_key(error.absolute_path) or 'the config'}: {error.message}") from None
    if decimals := list(dict.fromkeys(_decimals(config, schema, ""))):
        raise ValueError(decimals[0])


def _key(path) -> str:
    """A config key as a person writes it: ``study_b.chunk``, ``chunk_sizes[0]``."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".")


def _decimals(value, schema: dict, where: str):
    """The integer settings written with a decimal point (JSON Schema admits 3.0 as an integer), each a refusal."""
    types = schema.get("type", [])
    types = [types] if isinstance(types, str) else types
    if isinstance(value, float) and "integer" in types and "number" not in types:
        yield (f"{where}: {value!r} is not a whole number as written (it would count and name folders as "
               f"{value!r}); write {int(value)}")
    for alternative in schema.get("oneOf", []) + schema.get("anyOf", []):
        yield from _decimals(value, alternative, where)
    if isinstance(value, dict):
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            inner = schema.get("properties", {}).get(key, extra if isinstance(extra, dict) else None)
            if inner:
                yield from _decimals(item, inner, f"{where}.{key}" if where else key)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            yield from _decimals(item, schema["items"], f"{where}[{index}]")


def load(path: Path, repo: Path) -> dict:
    """A config file as the Snakefile sees it before validation: ``extends`` resolved."""
    config = yaml.safe_load(Path(path).read_text()) or {}
    resolve_extends(config, repo)
    return config


def _owned(args: list[str], owned: set[str]) -> list[str]:
    return sorted({arg.split("=", 1)[0] for arg in args if arg.split("=", 1)[0] in owned})


def _read_as_owned(args: list[str], owned: set[str]) -> dict[str, str]:
    """The options of ``args`` that vLLM's parser reads as one of ``owned`` although they are spelled otherwise:
    it reads underscores as dashes and takes any unambiguous prefix (no option of vLLM 0.32 is a prefix of one
    kvpool owns, so a prefix of an owned one is that option, or refused as ambiguous). Option -> owned option."""
    found = {}
    for arg in args:
        name = arg.split("=", 1)[0]
        spelled = "--" + name[2:].replace("_", "-")
        if not name.startswith("--") or name in owned or len(spelled) < 4:
            continue
        if reads := sorted(flag for flag in owned if flag.startswith(spelled)):
            found[name] = " or ".join(reads)
    return found


def _env_problems(section: str, env: dict) -> list[str]:
    """Names that no environment can hold (``=`` ends a name; a NUL byte ends the string), and values with a
    NUL byte: the launch would fail with the OS's error, after the plan."""
    return ([f"{section} key {key!r} cannot name an environment variable (it is empty or holds '=' or a NUL byte)"
             for key in env if not key or "=" in key or "\0" in key]
            + [f"{section}.{key}: {value!r} holds a NUL byte, which no environment value can"
               for key, value in env.items() if "\0" in value])


def _rate_problems(rates: list[float]) -> list[str]:
    """Each load rate must name a level of its own (``r<rate>``, kvpool.studies.load.Level) that reads back
    as that rate: a rate in exponent form names no level, and two rates that print alike would be one."""
    found, names = [], {}
    for rate in rates:
        name = Level("rate", float(rate)).name
        if not re.fullmatch(LEVEL_PATTERN, name) or Level.from_name(name).value != float(rate):
            found.append(f"load.rates {rate} cannot name a level (it prints as {name}): give rates from 0.0001 to "
                         "999999 requests per second with at most six significant digits")
        elif name in names:
            found.append(f"load.rates {names[name]} and {rate} both name the level {name}: give rates that differ "
                         "in their first six significant digits")
        names.setdefault(name, rate)
    return found


def _input_problems(config: dict) -> list[str]:
    """Values that would run something other than what the config says, or hang, each with the fix."""
    found = []
    engine, spec = config["engine"], config["random_model"]
    if owned := sorted(OWNED_LMCACHE_KEYS & set(config["lmcache"])):
        found.append(f"lmcache sets {', '.join(owned)}, which kvpool sets per cell (chunk_sizes, backends, tiers, "
                     "hash_keys); remove them from lmcache")
    if owned := _owned(engine["extra_args"], OWNED_ENGINE_FLAGS):
        found.append(f"engine.extra_args sets {', '.join(owned)}, which kvpool sets per replica; use the engine "
                     "keys (model, host, ports, dtype, max_model_len, gpu_memory_utilization) instead")
    for given, reads in _read_as_owned(engine["extra_args"], OWNED_ENGINE_FLAGS).items():
        found.append(f"engine.extra_args {given} reads as {reads} (vLLM reads underscores as dashes and takes "
                     "abbreviations), which kvpool sets per replica; use the engine keys (model, host, ports, dtype, "
                     "max_model_len, gpu_memory_utilization) instead")
    found += _env_problems("engine.env", engine["env"]) + _env_problems("lmcache_mp.env", config["lmcache_mp"]["env"])
    for key in sorted(set(engine["env"]) & set(OWNED_ENV)):
        found.append(f"engine.env sets {key}, which kvpool sets per replica: a cell would run with another value "
                     f"than its plan and folder name say; {OWNED_ENV[key]}")
    if owned := _owned(config["lmcache_mp"]["extra_args"], OWNED_SERVER_FLAGS):
        found.append(f"lmcache_mp.extra_args sets {', '.join(owned)}, which kvpool sets per server; use the "
                     "lmcache_mp keys (l1_size_gib, eviction_policy, l2_use_odirect, gpu_workers) instead")
    if not is_loopback(engine["host"]) and not engine["allow_remote"]:
        found.append(f"engine.host {engine['host']!r} listens beyond this machine: anyone who reaches it can send "
                     "the replicas requests (vLLM asks for no key); set engine.allow_remote: true to mean it "
                     "(pool servers stay on loopback either way), or bind 127.0.0.1")
    try:
        if ipaddress.ip_address(engine["host"]).version == 6:
            found.append(f"engine.host {engine['host']!r} is an IPv6 address; kvpool's replicas, pool servers and "
                         "port checks use IPv4: give an IPv4 address to bind (127.0.0.1 by default)")
    except ValueError:
        if engine["host"] != "localhost":  # a name would be looked up once per candidate port, and can hang
            found.append(f"engine.host {engine['host']!r} is not an IP address; give the address to bind "
                         "(127.0.0.1 by default)")
    for tier, path in config["tiers"].items():
        if path.startswith("~") or "$" in path:
            found.append(f"tiers.{tier}: {path!r} is taken literally (no ~ or $VARIABLE expansion); give the "
                         "expanded path")
    if engine["model"] is None and config["workload"]["documents"] > spec["vocab_words"]:
        found.append(f"workload.documents {config['workload']['documents']} exceeds random_model.vocab_words "
                     f"{spec['vocab_words']}: each document starts with a token of its own; raise vocab_words")
    if engine.get("batch_invariant") and engine["kind"] == "vllm-cpu":
        found.append("engine.batch_invariant needs the vllm engine on GPUs: vllm-cpu 0.32's batch-invariant mode "
                     "fails on its first request (its kernels are Triton's); set it to false")
    found += _followup_problems(config)
    if config["engine"]["model"] is None and spec["heads"] % spec["kv_heads"]:
        found.append(f"random_model.heads {spec['heads']} is not a multiple of random_model.kv_heads "
                     f"{spec['kv_heads']} (each KV head serves a whole group of query heads)")
    return found


def _pool_url_problems(config: dict, workdir: Path) -> list[str]:
    """Tier paths (and a working directory) that LMCache would read back as another folder than the cell's
    pool (kvpool.engine.pool_url): its replicas would share a pool outside kvpool's folder, which every
    cell and run would find warm. Named once per tier, with the folder LMCache would use."""
    if external.is_external(config):  # an external fleet's pool is where its replicas were told, not a tier
        return []
    found = {}
    for cell in cells(config):
        if (key := pool_backend(cell.backend).folder_key) is None:
            continue
        path, folder = config["tiers"][cell.tier], pool_dirs(config, cell, workdir)[0]
        if (elsewhere := pool_url.misread(key, folder)) is None:
            continue
        where = (f"{cell.backend} would keep its pool in {', '.join(map(repr, elsewhere))}, outside kvpool's folder, "
                 "shared by every cell and run and never emptied")
        if pool_url.misread(key, Path("/", path)) is not None:
            found.setdefault(cell.tier, f"tiers.{cell.tier}: {path!r} does not survive LMCache's {key} setting: "
                                        f"{where}; give a path without '#', '?', ',', tabs or line breaks")
        else:
            found.setdefault(cell.tier, f"the working directory {str(workdir)!r} puts tiers.{cell.tier}'s pools in a "
                                        f"folder LMCache's {key} setting does not read back: {where}; run from a "
                                        "directory whose path has no '#', '?', ',', tabs or line breaks")
    return list(found.values())


def _followup_problems(config: dict) -> list[str]:
    """Where several follow-ups per document cannot each be a cold reload from the pool, with the way out."""
    if config["workload"].get("followups_per_document", 1) <= 1:
        return []
    reason = None
    if external.is_external(config):
        reason = "an external fleet's prefix caches and pool are not kvpool's to empty between reloads"
    else:
        reason = next((why for cell in cells(config) if (why := pool_backend(cell.backend).followup_problem(
            config, cell)) is not None), None)
    if reason is None:
        return []
    return [f"workload.followups_per_document {config['workload']['followups_per_document']} cannot give cold "
            f"reloads here: {reason}; use more documents (workload.documents) with one follow-up each"]


def _in_hub_cache(model: str) -> bool:
    """Whether a hub model name is already in the local Hugging Face cache (its config.json is)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(model, "config.json"), str)


def _nearest_existing(path: Path) -> Path:
    """``path``, or its nearest parent that exists (a tier's folder is made when its first pool is)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def problems(config: dict, workdir: Path, check_paths: bool = True) -> list[str]:
    """Every reason ``config`` cannot run, each naming the key at fault; empty when it can.

    ``check_paths=False`` skips what only the machine that runs it can answer (tier directories,
    model directories), so a plan can be dry-run anywhere.
    """
    found = []
    engine, workload = config["engine"], config["workload"]
    replicas = config["replicas"]
    if engine["ports"] != "auto" and len(engine["ports"]) != replicas:
        found.append(f"engine.ports lists {len(engine['ports'])} ports for {replicas} replicas")
    if engine["kind"] == "vllm-cpu" and engine["cores"] != "auto" and len(engine["cores"]) < replicas:
        found.append(f"engine.cores lists {len(engine['cores'])} cores for {replicas} replicas")
    if engine["cores"] != "auto" and (twice := sorted({c for c in engine["cores"] if engine["cores"].count(c) > 1})):
        found.append(f"engine.cores lists core {', '.join(map(str, twice))} more than once: each listed core takes "
                     "one replica; to share cores, set auto (more replicas than cores then share them round robin, "
                     "and each cell's manifest records it)")
    found += _rate_problems(config["load"]["rates"])
    model = engine["model"]
    if check_paths and model and (model.startswith(("/", ".")) or Path(model).exists()) and not Path(model).is_dir():
        found.append(f"engine.model {model!r} is not a directory")
    elif check_paths and model and not Path(model).exists() and not _in_hub_cache(model):
        # a download inside a replica's startup would count against startup_timeout_s, per replica
        found.append(f"engine.model {model!r} is neither a local directory nor in the Hugging Face cache; "
                     f"download it first (hf download {model}) or give its path")
    # an external fleet's pool is where its replicas keep it, not under a tier kvpool creates
    for tier in config["tiers"] if check_paths and not external.is_external(config) else []:
        root = tier_root(config, tier, workdir)
        existing = _nearest_existing(root)
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            found.append(f"tiers.{tier}: {root} cannot be created ({existing} is not a writable directory)")
            continue
        found += _space_problems(config, tier, root, existing, workdir)
    # a level sends each document's follow-up once: N in flight needs a few documents per slot
    if deep := [n for n in config["load"]["concurrency"] if workload["documents"] < 2 * n]:
        found.append(f"load.concurrency {max(deep)} needs at least {2 * max(deep)} documents (two per follow-up in "
                     f"flight; each level sends every document's follow-up once) but workload.documents is "
                     f"{workload['documents']}: add documents or lower the level")
    total = workload["doc_tokens"] + workload["followup_tokens"] + workload["output_tokens"]
    if total > engine["max_model_len"]:
        found.append(f"a follow-up needs {total} tokens but engine.max_model_len is {engine['max_model_len']}")
    if config["engine"]["model"] is None and total > config["random_model"]["max_positions"]:
        found.append(f"a follow-up needs {total} tokens but random_model.max_positions is "
                     f"{config['random_model']['max_positions']}")
    for chunk in config["chunk_sizes"]:
        loadable = (workload["doc_tokens"] // chunk) * chunk
        if Arm.SHARED in config["arms"] and loadable < config["min_hit_fraction"] * workload["doc_tokens"]:
            found.append(f"with chunk size {chunk} at most {loadable} of {workload['doc_tokens']} document tokens "
                         f"can come from the pool, below min_hit_fraction {config['min_hit_fraction']}; "
                         f"use doc_tokens that are (close to) a multiple of the chunk size")
    if check_paths and engine["kind"] == "vllm-cpu" and engine["cores"] != "auto":
        missing = sorted(set(engine["cores"]) - os.sched_getaffinity(0))
        if missing:
            found.append(f"engine.cores lists cores {missing} that this process may not run on "
                         f"(it may use {sorted(os.sched_getaffinity(0))})")
    if check_paths and not external.is_external(config):
        found += host_memory.problems(config)
    for arm, folders in config["fleet"]["pool_dirs"].items() if check_paths and external.is_external(config) else []:
        # kvpool reads every file under them at populate, and a walk that meets a folder it cannot read fails
        found += [f"fleet.pool_dirs.{arm}: {folder!r} is not a folder this machine can read" for folder in
                  dict.fromkeys(folders) if not (Path(folder).is_dir() and os.access(folder, os.R_OK | os.X_OK))]
    if config["fault_injection"]["corrupt_stored_chunk"]:
        if memory := [cell.name for cell in cells(config) if is_memory_pool(config, cell)]:
            found.append(f"fault_injection.corrupt_stored_chunk needs pools of files; {memory[0]} is an MP "
                         "server's memory (drop it from the matrix: its tier from lmcache_mp.memory_tiers, or the "
                         "lmcache-redis backend)")
    if config["study_b"]["enabled"]:
        try:
            found += studyb_pool.problems(config)
        except ValueError as exc:
            found.append(str(exc))
    return (found + contexts.problems(config) + capacity.problems(config, check_host=check_paths)
            + _input_problems(config) + _pool_url_problems(config, workdir)
            + [problem for pool in configured(config) for problem in pool.problems(config)]
            + [f"backends: {pool.name} {pool.hybrid_refusal}" for pool in configured(config)
               if pool.hybrid_refusal and shapes.is_hybrid(config)]
            + external.problems(config)
            + peer.problems(config)
            + trace_replay.problems(config, check_paths)
            + shapes.problems(config))


def pool_bytes_per_cell(config: dict, arm: str) -> int | None:
    """The KV bytes one cell's pool holds after its reuse phase; None for a model whose KV size this
    workflow cannot read (a real model that is not a local directory with a config.json).

    Populate stores every document once. In reuse the serving replica stores what it computed:
    the follow-up's new tokens in the shared arm, and in the isolated arm the whole prompt again
    (its own pool never held the document), so an isolated pool ends up about twice the size.
    """
    per_token = engine_pool_bytes_per_token(config)
    if per_token is None:
        return None
    workload = config["workload"]
    stored = workload["doc_tokens"] * (2 if arm == Arm.ISOLATED else 1) + workload["followup_tokens"]
    return workload["documents"] * stored * per_token


def _space_problems(config: dict, tier: str, root: Path, existing: Path, workdir: Path) -> list[str]:
    # an MP memory pool lives in its server's RAM, not in the tier's directory
    on_tier = [cell for cell in cells(config) if cell.tier == tier and not is_memory_pool(config, cell)]
    sizes = [pool_bytes_per_cell(config, cell.arm) for cell in on_tier]
    if not sizes or None in sizes:
        return []
    # A router unit's own pool (kvpool.studies.routers) stores each document once and, where a request lands
    # on a replica that never held it without a shared pool, again: at most twice an isolated cell's.
    routers = [2 * size for size in sizes for _ in config["routers"]["names"]]
    # A length unit's pool (kvpool.studies.contexts) holds its chains' documents and questions once, one per
    # shared cell of the tier and length; a capacity unit's pool of files (kvpool.studies.capacity) is an
    # image of its capacity on the tier.
    per_token = engine_pool_bytes_per_token(config)
    lengths = [config["contexts"]["chains"] * (tokens + config["workload"]["followup_tokens"]) * per_token
               for tokens in config["contexts"]["doc_tokens"] for cell in contexts.cells(config) if cell in on_tier]
    images = capacity.drive_tier_images(config, tier)
    # A trace unit's pool stores each sent prompt's whole chunks at most once (kvpool.studies.trace_replay)
    traced = [cell for cell, _ in trace_replay.units(config) if cell.tier == tier and cell.arm != Arm.OFF
              and not is_memory_pool(config, cell)]
    replays = [trace_replay.pool_bound_tokens(config) * per_token] * len(traced) if traced else []
    units = routers + lengths + images + replays
    # kept pools accumulate; otherwise the tier holds one cell's pool at a time, the largest, and at
    # most one unit's (a router's or a length's) beside it
    pools = sum(sizes + units) if config["keep_pools"] else max(sizes) + max(units, default=0)
    needed = pools + config["drive_ceiling_bytes"]
    # Pools already in the tier are replaced cell by cell, so their space counts as available.
    available = shutil.disk_usage(existing).free + _tree_bytes(run_pools(config, tier, workdir))
    if needed <= available:
        return []
    held = (f"{len(sizes) + len(units)} pools" if config["keep_pools"]
            else "the largest pool"
            + (" and a router unit's" if routers else " and a length unit's" if lengths
               else " and a capacity unit's image" if images else " and a trace unit's" if replays else ""))
    return [f"tiers.{tier}: {root} has {available / 1e9:.2f} GB available but needs {needed / 1e9:.2f} GB "
            f"({held}, {pools / 1e9:.2f} GB, plus the {config['drive_ceiling_bytes'] / 1e9:.2f} GB "
            f"ceiling file); free space, lower workload.documents"
            f"{'' if not config['keep_pools'] else ', or set keep_pools: false'}"]


def _tree_bytes(root: Path) -> int:
    return sum(entry.stat().st_size for entry in root.rglob("*") if entry.is_file()) if root.is_dir() else 0


def unbuilt_targets(dag) -> list[str]:
    """What a finished Snakemake run was asked to build and did not: none unless Snakemake cut the run
    short by itself. Snakemake 9 skips every job below one that reruns for changed params when the link
    between them is ``ancient`` (snakemake/snakemake#4166), as every fleet job's link to the launch
    check is: a config change then reran the launch check alone and reported success. A run the user
    cut short on purpose (``--until``, ``--omit-from``) is not judged."""
    if dag.untilrules or dag.untilfiles or dag.omitrules or dag.omitfiles:
        return []
    return sorted(target for target in dag.derived_targetfiles if not Path(target).exists())


def unbuilt_message(missing: list[str]) -> str:
    return (f"kvpool: Snakemake ended without building {len(missing)} of the targets it was asked for "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): it reran only the jobs above "
            "an ancient input (snakemake/snakemake#4166) and called it done; nothing measured is lost. "
            "Run the same command again to build them.")
