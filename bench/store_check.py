"""Does a replica get back the KV it stored? One replica, a fresh pool, one LMCache setting at a time.

The H200 runs found the shared arm's outputs wrong and the stored chunks unlike a recompute (store
side). This takes the second replica out: one replica stores and reloads its own KV. For each
document's follow-up prompt,

1. ``cold``: computed from nothing (the pool is fresh), and LMCache stores every chunk of it;
2. the replica's GPU prefix cache is reset (vLLM's dev endpoint; the pool is kept);
3. ``reload``: the same prompt again, now loaded from the pool (measured: the replica's
   ``external_kv_transfer`` tokens), only the last token computed.

Equal KV gives equal greedy tokens, so ``reload`` must equal ``cold``. Each ``--variant NAME=JSON``
starts its own replica, with JSON's LMCache settings over kvpool's (e.g. ``'{"use_layerwise":
true}'``: LMCache 0.5.3's layerwise GPU connector makes its store stream wait for the compute
stream, the default connector's does not). JSON's ``"env"`` object, if any, is added to the
replica's environment instead: ``'{"env": {"CUDA_LAUNCH_BLOCKING": "1"}}'`` makes every CUDA launch
wait for the kernel, so no copy can overtake the forward pass that writes the KV.

    python bench/store_check.py WORKDIR --configfile config/h200.yaml --documents 2 \\
        --variant default='{}' --variant layerwise='{"use_layerwise": true}'

WORKDIR is a pipeline run's working directory: the model and ``results/workload/prompts.jsonl``
come from there. Writes ``WORKDIR/results/store-check.csv`` and prints one line per variant.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import shutil
import sys
from pathlib import Path

import pandas as pd
import yaml
from snakemake.utils import validate

from kvpool.cells import Cell
from kvpool.engine.client import new_session
from kvpool.engine.fleet import running_fleet
from kvpool.engine.model import RANDOM_MODEL_DIR
from kvpool.engine.plan import fleet_plan
from kvpool.engine.plan_types import Plan
from kvpool.engine.pool_files import pool_files
from kvpool.engine.ports import free_ports
from kvpool.engine.prompts import read_workload
from kvpool.measure.timed import measured_request

REPO = Path(__file__).resolve().parents[1]


def variant(text: str) -> tuple[str, dict]:
    name, _, settings = text.partition("=")
    parsed = json.loads(settings or "{}")
    if not name or not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"--variant takes NAME=JSON-object, got {text!r}")
    env = parsed.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise argparse.ArgumentTypeError(f"--variant {name}: \"env\" must map names to strings, got {env!r}")
    return name, parsed


def single_replica_plan(config: dict, workdir: Path, name: str, settings: dict, pool_root: Path) -> Plan:
    """kvpool's launch plan for one replica of the config's engine, its own pool under ``pool_root``."""
    config = copy.deepcopy(config)
    config["replicas"] = 1
    config["engine"]["replicas_per_gpu"] = 1
    config["engine"]["gpus"] = (config["engine"]["gpus"] if config["engine"]["gpus"] == "auto"
                                else config["engine"]["gpus"][:1])
    settings = dict(settings)
    config["engine"]["env"] = {**config["engine"]["env"], **settings.pop("env", {})}
    config["lmcache"] = {**config["lmcache"], **settings}
    config["tiers"] = {"check": str(pool_root / name)}
    cell = Cell(config["backends"][0], "shared", config["chunk_sizes"][0], "check")
    model = config["engine"]["model"] or str(workdir / RANDOM_MODEL_DIR)
    cell_dir = workdir / "results" / "store-check" / name
    cell_dir.mkdir(parents=True, exist_ok=True)
    plan = fleet_plan(config, cell, model, cell_dir, free_ports(config["engine"]["host"], 1), "free",
                      dev_mode=True)  # for POST /reset_prefix_cache
    Path(plan.replicas[0].pool_dir).mkdir(parents=True, exist_ok=True)
    return plan


async def check(replica, workload: list[dict], output_tokens: int, timeout_s: float) -> list[dict]:
    """Each document's follow-up cold, then after a GPU prefix-cache reset, with the pool's hits proven
    as the pipeline proves them (timed.measured_request: the replica's /metrics around the request)."""
    rows = []
    async with new_session() as session:
        for item in workload:
            row = {"doc_id": item["doc_id"]}
            for path in ("cold", "reload"):
                if path == "reload":
                    async with session.post(f"{replica.url}/reset_prefix_cache") as response:
                        response.raise_for_status()
                        if not (await response.json())["success"]:
                            raise RuntimeError(f"{replica.url}/reset_prefix_cache did not reset the GPU prefix cache")
                result, counts = await measured_request(session, replica, item["followup"], output_tokens, timeout_s)
                if result.error:  # e.g. the engine died on this setting: its log says why
                    raise RuntimeError(f"document {item['doc_id']}, {path} request failed: {result.error}")
                row.update({f"{path}_ttft_s": result.ttft_s,
                            f"{path}_external_hit_tokens": counts["external_kv_transfer"],
                            f"{path}_output": result.output_text})
            row["matches"] = row["cold_output"] == row["reload_output"]
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path, help="a pipeline run's working directory (model, prompts)")
    parser.add_argument("--configfile", type=Path, required=True)
    parser.add_argument("--documents", type=int, default=2, help="how many of the run's documents")
    parser.add_argument("--variant", type=variant, action="append", required=True, help="NAME=JSON LMCache settings")
    parser.add_argument("--pool-root", type=Path, default=Path("/dev/shm/kvpool-store-check"))
    args = parser.parse_args()
    config = yaml.safe_load(args.configfile.read_text())
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    prompts = args.workdir / "results" / "workload" / "prompts.jsonl"
    if not prompts.exists():
        sys.exit(f"{prompts} is missing: run `snakemake results/workload/prompts.jsonl` in {args.workdir} first")
    workload = read_workload(prompts)[:args.documents]
    rows = []
    for name, settings in args.variant:
        pool = args.pool_root / name
        shutil.rmtree(pool, ignore_errors=True)  # fresh: the cold path must find nothing
        plan = single_replica_plan(config, args.workdir.resolve(), name, settings, args.pool_root)
        try:
            with running_fleet(plan, args.workdir / "logs" / "store-check" / name,
                               config["engine"]["startup_timeout_s"]) as replicas:
                found = asyncio.run(check(replicas[0], workload, config["workload"]["output_tokens"],
                                          config["engine"]["request_timeout_s"]))
            stored = len(pool_files([pool]))
        except Exception as error:  # one setting that does not start or answer leaves the others to run
            print(f"{name}: FAILED: {error} (replica log: {args.workdir / 'logs' / 'store-check' / name})", flush=True)
            rows.append({"variant": name, "lmcache": json.dumps(settings), "error": str(error)})
            continue
        finally:
            shutil.rmtree(pool, ignore_errors=True)
        rows += [{"variant": name, "lmcache": json.dumps(settings), "pool_files": stored, **row} for row in found]
        ok = sum(row["matches"] for row in found)
        loaded = [row["reload_external_hit_tokens"] for row in found]
        print(f"{name}: reload matches cold on {ok} of {len(found)}; tokens loaded from the pool per reload "
              f"{loaded}; {stored} chunk files stored", flush=True)
    out = args.workdir / "results" / "store-check.csv"
    pd.DataFrame(rows).convert_dtypes().to_csv(out, index=False)
    print(out)


if __name__ == "__main__":
    main()
