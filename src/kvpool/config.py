"""Checks on a schema-valid config that JSON Schema cannot express, run before any job starts."""

from __future__ import annotations

import os
from pathlib import Path

from kvpool.cells import tier_root


def _nearest_existing(path: Path) -> Path:
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
    model = engine["model"]
    if check_paths and model and (model.startswith(("/", ".")) or Path(model).exists()) and not Path(model).is_dir():
        found.append(f"engine.model {model!r} is not a directory")
    for tier in config["tiers"] if check_paths else []:
        root = tier_root(config, tier, workdir)
        existing = _nearest_existing(root)
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            found.append(f"tiers.{tier}: {root} cannot be created ({existing} is not a writable directory)")
    total = workload["doc_tokens"] + workload["followup_tokens"] + workload["output_tokens"]
    if total > engine["max_model_len"]:
        found.append(f"a follow-up needs {total} tokens but engine.max_model_len is {engine['max_model_len']}")
    if config["engine"]["model"] is None and total > config["random_model"]["max_positions"]:
        found.append(f"a follow-up needs {total} tokens but random_model.max_positions is "
                     f"{config['random_model']['max_positions']}")
    for chunk in config["chunk_sizes"]:
        loadable = (workload["doc_tokens"] // chunk) * chunk
        if "shared" in config["arms"] and loadable < config["min_hit_fraction"] * workload["doc_tokens"]:
            found.append(f"with chunk size {chunk} at most {loadable} of {workload['doc_tokens']} document tokens "
                         f"can come from the pool, below min_hit_fraction {config['min_hit_fraction']}; "
                         f"use doc_tokens that are (close to) a multiple of the chunk size")
    return found
