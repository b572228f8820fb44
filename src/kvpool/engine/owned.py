"""What kvpool owns in a launch, decided by the programs that read it: vLLM's argument parser for a
replica's command line, LMCache's config loader for its config file and environment, LMCache's server
parser for a pool server's command line.

kvpool sets a replica's model, port, dtype, length and connector, the chunk size and pool of its LMCache
config, and a pool server's ports and sizes. A user's ``extra_args`` and ``env`` may add settings but not
change these. String matching cannot tell: vLLM's parser reads ``--max_model_len`` and abbreviations
(``--max-model``) as ``--max-model-len``, and LMCache reads ``LMCACHE_<KEY>`` (and its old names) over
its file. So each launch is parsed twice by its own program, with kvpool's settings alone and with the
user's added: a setting kvpool gave that comes out different is refused before any fleet starts.
"""

import argparse
import contextlib
import dataclasses
import io
import logging
import os
import tempfile
from pathlib import Path
from unittest import mock

import yaml

from kvpool.engine.plan_types import Plan

# kvpool writes these into each replica's LMCache file (kvpool.engine.plan.lmcache_config); the rest of
# the file is the config's own `lmcache` section, the user's to change.
OWNED_LMCACHE_KEYS = frozenset({"chunk_size", "remote_url", "remote_serde", "local_disk", "max_local_disk_size",
                                "local_cpu", "pre_caching_hash_algorithm"})


class ParseError(ValueError):
    """The launch's own program refuses its command line."""


def _parse(parser: argparse.ArgumentParser, args: list[str]) -> dict:
    """``args`` as ``parser`` reads them; argparse's exit on a bad line becomes a ParseError with its message."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return vars(parser.parse_args(args))
    except SystemExit as exited:
        message = stderr.getvalue().strip().splitlines()
        raise ParseError(message[-1] if message else f"the parser exited with {exited.code}") from None


def _given_dests(parser: argparse.ArgumentParser, args: list[str]) -> set[str]:
    """The destinations of the options in ``args`` (kvpool's own line: full option names only)."""
    actions = parser._option_string_actions  # argparse has no public map from an option to its destination
    return {actions[arg.split("=", 1)[0]].dest for arg in args if arg.split("=", 1)[0] in actions}


def _fields(value):
    """A parsed value as comparable data: a config object (vLLM parses --kv-transfer-config into one) as its
    fields."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def _change(mine, again, theirs) -> str | None:
    """How ``theirs`` differs from ``mine`` as a person reads it, or None: a config object (vLLM parses
    --kv-transfer-config into one) by the fields that differ, among those two parses of kvpool's line
    agree on (vLLM draws a fresh engine_id per parse: that is not a setting)."""
    mine, again, theirs = _fields(mine), _fields(again), _fields(theirs)
    if isinstance(mine, dict) and isinstance(theirs, dict):
        keys = sorted(key for key in mine.keys() | theirs.keys()
                      if mine.get(key) == again.get(key) and mine.get(key) != theirs.get(key))
        return ", ".join(f"{key} from {mine.get(key)!r} to {theirs.get(key)!r}" for key in keys) or None
    return f"from {mine!r} to {theirs!r}" if mine != theirs else None


def vllm_parser() -> argparse.ArgumentParser:
    """The parser of vLLM's OpenAI server (the `vllm serve` command and the api_server module both use it)."""
    try:  # vLLM 0.32's places, then the earlier ones (0.26, the GPU bundle's)
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def server_parser() -> argparse.ArgumentParser:
    """The parser of LMCache's `lmcache server` command."""
    from lmcache.cli.commands.server import ServerCommand

    parser = argparse.ArgumentParser(prog="lmcache server")
    ServerCommand().add_arguments(parser)
    return parser


def engine_options(argv: list[str]) -> list[str]:
    """A replica's command line as options for vLLM's parser: `vllm serve MODEL` and the api_server module's
    `--model MODEL` both become the latter."""
    if argv[:2] == ["vllm", "serve"]:
        return ["--model", argv[2], *argv[3:]]
    module = argv.index("-m")
    return argv[module + 2:]


def lmcache_changes(file_config: dict, file_path: str, env: dict) -> dict[str, tuple]:
    """The keys kvpool wrote into a replica's LMCache file (``file_config``, to go to ``file_path``) that its
    environment (``os.environ`` and the replica's own) changes, as LMCache's loader applies them:
    key -> (file value, value LMCache would use)."""
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.config_base import load_config_with_overrides

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "lmcache.yaml"
        path.write_text(yaml.safe_dump(file_config))
        launched = {**os.environ, **env}
        if launched.get("LMCACHE_CONFIG_FILE") == file_path:  # not written yet: the same content, here
            launched["LMCACHE_CONFIG_FILE"] = str(path)
        logging.disable(logging.INFO)  # the loader logs the whole config at INFO, once per replica
        try:
            alone = LMCacheEngineConfig.from_file(str(path))
            with mock.patch.dict(os.environ, launched, clear=True):
                loaded = load_config_with_overrides(LMCacheEngineConfig)
        finally:
            logging.disable(logging.NOTSET)
    return {key: (getattr(alone, key), getattr(loaded, key)) for key in sorted(OWNED_LMCACHE_KEYS)
            if key in file_config and getattr(alone, key) != getattr(loaded, key)}


def problems(launches: list[dict]) -> list[str]:
    """What the launches would run otherwise than kvpool planned them, each problem once with the launches
    it holds for. A launch: ``name``; ``engine_own`` and ``engine_extra`` (a replica's options),
    ``lmcache_config``, ``lmcache_config_file`` and ``env`` (its LMCache config), or ``server_own`` and
    ``server_extra`` (a pool server's)."""
    found: dict[str, list[str]] = {}
    parsers = {}
    programs = {"engine": ("engine.extra_args", "vLLM", vllm_parser, "replica"),
                "server": ("lmcache_mp.extra_args", "`lmcache server`", server_parser, "pool server")}
    for launch in launches:
        for kind, (where, program, make_parser, what) in programs.items():
            if f"{kind}_own" not in launch:
                continue
            parser = parsers.setdefault(kind, make_parser())
            own, extra = launch[f"{kind}_own"], launch[f"{kind}_extra"]
            try:
                mine, again, theirs = _parse(parser, own), _parse(parser, own), _parse(parser, own + extra)
            except ParseError as refused:
                found.setdefault(f"{where} {extra} is refused by {program}'s parser: {refused}", []).append(
                    launch["name"])
                continue
            for dest in sorted(_given_dests(parser, own)):
                if change := _change(mine[dest], again[dest], theirs[dest]):
                    found.setdefault(f"{where} changes {dest} ({change}), which kvpool sets per {what} and records "
                                     "in the plan: use the config's own key", []).append(launch["name"])
        if launch.get("lmcache_config") is not None:
            changes = lmcache_changes(launch["lmcache_config"], launch["lmcache_config_file"], launch["env"])
            for key, (mine, theirs) in changes.items():
                found.setdefault(f"the environment changes LMCache's {key} from {mine!r} (kvpool's, in the "
                                 f"replica's config file) to {theirs!r}: unset LMCACHE_{key.upper()} (LMCache "
                                 "reads it over the file)", []).append(launch["name"])
    return [f"{problem} [{_names(names)}]" for problem, names in found.items()]


def _names(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 2 else f"{names[0]}, {names[1]} and {len(names) - 2} more"


def launches(plan: Plan, engine_extra: list[str], server_extra: list[str]) -> list[dict]:
    """A fleet plan's launches as ``problems`` reads them: each replica's and pool server's command line
    split into kvpool's part and the user's (the plan appends ``engine_extra`` and ``server_extra`` last)."""
    def split(argv, extra):
        return argv[:len(argv) - len(extra)], list(extra)

    found = []
    for replica in plan.replicas:
        own, extra = split(engine_options(replica.argv), engine_extra)
        found.append({"name": f"{plan.cell} replica {replica.index}", "engine_own": own, "engine_extra": extra,
                      "lmcache_config": replica.lmcache_config,
                      "lmcache_config_file": replica.lmcache_config_file, "env": replica.env})
    for server in plan.servers:
        if server.kind == "lmcache":  # `lmcache server ...`; a Redis server takes lmcache_redis.extra_args
            own, extra = split(server.argv[2:], server_extra)
            found.append({"name": f"{plan.cell} pool server {server.index}", "server_own": own,
                          "server_extra": extra})
    return found
