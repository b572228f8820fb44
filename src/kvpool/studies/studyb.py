"""Study B's design: independently restarted blocks of two replicas, OFF (no KV connector: vLLM's own
prefix cache only) and ON (the shared pool), run in the order OFF, ON, ON, OFF.

Each block sends the same payloads: per context length a locality chain (cold on replica A, local on
A twice, cross-replica on B, local on B; Study B's Table 3) and sessions of several turns, each turn
its predecessor's prompt and answer plus new tokens, on one replica (``fixed``) or switching replicas
(``alternating``; Study B's Table 4). ON and OFF requests pair by the SHA-256 of their payload and
their target replica: paired changes come from the same request with and without the pool, and equal
greedy answers across a pair show that the pool's KV is the KV the replica computes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from enum import StrEnum
from pathlib import Path

import numpy as np
import pandas as pd

from kvpool.cells import Arm, Cell, run_pools
from kvpool.engine import metrics
from kvpool.engine.backends import configured, pool_backend
from kvpool.engine.model import vocabulary
from kvpool.engine.plan import batch_invariant, plan_pool_dirs
from kvpool.engine.plan_types import Plan, write_plan
from kvpool.engine.pool_files import corrupt, pool_files
from kvpool.measure import legacy, provenance, records
from kvpool.measure import reference as split_reference
from kvpool.measure.checks import FAILED, check, not_applicable, status, verdict
from kvpool.measure.files import read_json, write_json
from kvpool.measure.records import ChainRecord
from kvpool.measure.reference import payload_sha256
from kvpool.measure.reuse_checks import outputs_check
from kvpool.measure.timed import chain_fleet, recompute_in_splits, recording_sends
from kvpool.measure.unit import with_retrievals
from kvpool.measure.unit_plan import checked_ports, new_plan, unit_pool
from kvpool.measure.validity import with_served
from kvpool.settings import PHASE_SETTINGS, pool_sections, reads
from kvpool.studies.chain_stores import StoresLanded, stores_landed
from kvpool.studies.studyb_reference import PREDICTED, known_answers, predicted_pool_splits


class Block(StrEnum):
    """A Study B block's arm: OFF, no KV connector (its cell's arm is Arm.OFF), or ON, the study's shared pool."""
    OFF = "off"
    ON = "on"


OFF, ON = Block.OFF, Block.ON
SEQUENCE = (OFF, ON, ON, OFF)
# A chain's steps and the replica each goes to (A prefills, B never saw the document before "cross").
CHAIN = (("cold", "A"), ("local-1", "A"), ("local-2", "A"), ("cross", "B"), ("local-B", "B"))


def resolved(config: dict) -> dict:
    """``study_b`` with its pool named (backend, tier, chunk) and checked against the matrix."""
    study = legacy.study_b(config["study_b"])
    sharing = [pool.name for pool in configured(config) if pool.shares]
    study["backend"] = study["backend"] or (sharing[0] if sharing else config["backends"][0])
    study["tier"] = study["tier"] or ("ram" if "ram" in config["tiers"] else next(iter(config["tiers"])))
    study["chunk"] = config["chunk_sizes"][0] if study["chunk"] is None else study["chunk"]
    if study["backend"] not in config["backends"]:
        raise ValueError(f"study_b.backend {study['backend']!r} is not one of backends {config['backends']}")
    if study["tier"] not in config["tiers"]:
        raise ValueError(f"study_b.tier {study['tier']!r} is not one of tiers {sorted(config['tiers'])}")
    # a step that injects no fault does not declare the setting
    backend = pool_backend(study["backend"])
    if config.get("fault_injection", {}).get("corrupt_stored_chunk") and not backend.corruptible:
        raise ValueError(f"fault_injection.corrupt_stored_chunk needs a study_b.backend whose replicas read a pool of "
                         f"files kvpool can corrupt (lmcache-fs), not {study['backend']}")
    if not backend.shares:
        raise ValueError(f"study_b.backend {backend.name} cannot share a pool between replicas: add a backend that "
                         "does (lmcache-fs, lmcache-mp, vllm-fs) to backends (study_b uses the first), or set "
                         "study_b.enabled: false")
    partial = [c for c in study["contexts"] if c % study["chunk"]]
    if partial:
        raise ValueError(f"study_b.contexts {partial} are not whole chunks of {study['chunk']} tokens: "
                         "a cross-replica hit could not cover the document")
    answer = config["workload"]["output_tokens"]
    turns = max(study["turns"], study["window_turns"] if study["windows"] else 0)
    longest = max(max(study["contexts"]) + study["question_tokens"] + answer, session_length(study, turns, answer))
    if longest > config["engine"]["max_model_len"]:
        raise ValueError(f"study_b's longest request needs {longest} tokens (prompt and answer), more than "
                         f"engine.max_model_len {config['engine']['max_model_len']}")
    if config["engine"]["model"] and config["workload"]["output_tokens"] < PLANTED_ANSWER_TOKENS:
        raise ValueError(f"study_b asks a real model for three planted six-digit codes: workload.output_tokens "
                         f"{config['workload']['output_tokens']} is too few to answer, give at least "
                         f"{PLANTED_ANSWER_TOKENS}")
    if config["replicas"] < 2:
        raise ValueError("study_b needs two replicas or more (a cross-replica step and alternating sessions)")
    return study


def session_length(study: dict, turns: int, answer: int) -> int:
    """A session's tokens after ``turns`` turns: its first context, each later turn's new tokens after the previous
    answer, and the last answer."""
    return study["session_tokens"] + (turns - 1) * (study["turn_tokens"] + answer) + answer


def block_study(study: dict) -> dict:
    """What Study B's blocks measure: the resolved study less how many blocks run (``repeats``) and
    whether ``all`` builds them (``enabled``), so a change to either re-runs no measured block."""
    return {key: value for key, value in study.items() if key not in ("repeats", "enabled")}


def blocks(study: dict) -> list[str]:
    """Block names in run order: ``1-off``, ``2-on``, ``3-on``, ``4-off``, then again per repeat."""
    arms = SEQUENCE * study["repeats"]
    return [f"{i}-{arm}" for i, arm in enumerate(arms, start=1)]


def block_arm(name: str) -> str:
    return name.split("-", 1)[1]


def block_position(name: str) -> int:
    """Where block ``name`` stands in its OFF, ON, ON, OFF (0 to 3)."""
    return (int(name.split("-", 1)[0]) - 1) % len(SEQUENCE)


def block_pairs(names: list[str]) -> list[tuple[str, str]]:
    """(OFF block, ON block) pairs of ``names`` (run order, possibly cut short): in each OFF, ON, ON, OFF
    the first two and the last two."""
    present = set(names)
    pairs = []
    for start in range(0, len(names), len(SEQUENCE)):
        number = start // len(SEQUENCE)
        first, second, third, fourth = (f"{number * len(SEQUENCE) + i}-{arm}" for i, arm in
                                        enumerate(SEQUENCE, start=1))
        pairs += [pair for pair in ((first, second), (fourth, third)) if set(pair) <= present]
    return pairs


def block_cell(study: dict, arm: str) -> Cell:
    """The plan's cell of a block: the shared arm of the study's pool (ON), or no connector (OFF)."""
    return Cell(study["backend"], Arm.SHARED if arm == ON else Arm.OFF, study["chunk"], study["tier"])


PLANTED_LABELS = ("alpha", "bravo", "charlie")
PLANTED_ANSWER_TOKENS = 32
PLANTED_QUESTION = "\nWhat are the codes for alpha, bravo and charlie? Answer with the three numbers only.\n"


def plant(document: list[int], codes: list[str], encode: Callable[[str], list[int]]) -> list[int]:
    """``document`` with a sentence naming each code written over its tokens near the start, in the
    middle and at the end (Study B's planted values); the length stays the same."""
    sentences = [encode(f" The code for {label} is {code}. ") for label, code in zip(PLANTED_LABELS, codes,
                                                                                      strict=True)]
    length = len(document)
    if sum(map(len, sentences)) + 2 > length:
        raise ValueError(f"a {length}-token document cannot hold three planted sentences")
    starts = [1, (length - len(sentences[1])) // 2, length - len(sentences[2])]
    planted = list(document)
    for start, sentence in zip(starts, sentences, strict=True):
        planted[start:start + len(sentence)] = sentence
    return planted


def recalled(output_text: str, codes: list[str]) -> bool:
    return all(code in output_text for code in codes)


def make_workload(token_ids: list[int], study: dict, replicas: int,
                  encode: Callable[[str], list[int]] | None = None) -> dict:
    """Every block's payloads: one document per chain and per session, each with a first token of its
    own (no two share a cacheable prefix), and each session's new tokens per later turn; seeded.

    With ``encode`` (a real model's tokenizer) each chain's document carries three planted codes and
    its question asks for them, so every answer can be checked exactly, as Study B did; the random
    model cannot answer, so without it the question is random tokens."""
    rng = np.random.default_rng(study["seed"])
    pool = np.asarray(token_ids)
    chains = [(context, k) for context in study["contexts"] for k in range(study["chains"])]
    sessions = [(placement, s) for placement in study["placements"] for s in range(study["sessions"])]
    windows = [(size, placement, s) for size in study["windows"] for placement in study["placements"]
               for s in range(size)]
    documents = len(chains) + len(sessions) + len(windows) + study["warmups"]
    if documents > len(pool):
        raise ValueError(f"study_b needs {documents} documents with distinct first tokens; the vocabulary has "
                         f"{len(pool)}")
    firsts = iter(rng.choice(pool, size=documents, replace=False).tolist())

    def document(tokens: int) -> list[int]:
        return [int(next(firsts))] + rng.choice(pool, size=tokens - 1).tolist()

    question = rng.choice(pool, size=study["question_tokens"]).tolist() if encode is None \
        else encode(PLANTED_QUESTION)
    chain_items = []
    for index, (context, k) in enumerate(chains):
        a = index % replicas
        item = {"context": context, "chain": k, "replicas": {"A": a, "B": (a + 1) % replicas}}
        body = document(context)
        if encode is not None:
            item["planted"] = [str(code) for code in rng.integers(100000, 1000000, size=len(PLANTED_LABELS))]
            body = plant(body, item["planted"], encode)
        chain_items.append({**item, "prompt": body + question})
    session_items = [{"placement": placement, "session": s, "first": document(study["session_tokens"]),
                      "increments": [rng.choice(pool, size=study["turn_tokens"]).tolist()
                                     for _ in range(study["turns"] - 1)]}
                     for placement, s in sessions]
    window_items = [{"window": size, "placement": placement, "session": s, "first": document(study["session_tokens"]),
                     "increments": [rng.choice(pool, size=study["turn_tokens"]).tolist()
                                    for _ in range(study["window_turns"] - 1)]}
                    for size, placement, s in windows]
    # warm-ups: one chunk each, prefixes of their own, so they leave nothing a measured request could find
    warmups = [document(study["chunk"]) for _ in range(study["warmups"])]
    return {"chains": chain_items, "sessions": session_items, "windows": window_items, "warmups": warmups}


def session_replica(placement: str, session: int, turn: int, replicas: int) -> int:
    return session % replicas if placement == "fixed" else (session + turn) % replicas


# One request, sequentially (the serving replica's /metrics deltas are this request's): the replica's
# index and the prompt in; a RequestResult (with the answer's token ids) and the deltas back.
Send = Callable[[int, list[int]], Awaitable[tuple]]


def decode_rate(result, output_tokens: int) -> float:
    """Study B's decode rate at the client: (N_out - 1) / (last token - first token), the stream's end
    standing for the last token."""
    span = result.e2e_s - result.ttft_s
    return (output_tokens - 1) / span if output_tokens > 1 and span > 0 else float("nan")


def _row(block: str, result, counts: dict, replica: int, prompt: list[int], **where) -> dict:
    row = {"decode_tokens_per_s": decode_rate(result, len(result.output_token_ids)),
           "block": block, "arm": block_arm(block), "replica": replica, "payload_sha256": payload_sha256(prompt),
           "prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens,
           "local_hit_tokens": counts.get("local_cache_hit"), "external_hit_tokens": counts.get("external_kv_transfer"),
           "computed_tokens": counts.get("local_compute"), "ttft_s": result.ttft_s, "e2e_s": result.e2e_s,
           "started_at": result.started_at, "finished_at": time.time(), "output_text": result.output_text,
           "error": result.error or None, "request_id": result.request_id, **metrics.request_timings(counts),
           **where}
    return records.row(ChainRecord, **row)


async def run_block(send: Send, block: str, workload: dict, study: dict, replicas: int,
                    before_step: Callable[[str], None] | None = None, send_together: Send | None = None,
                    wait_for_stores: StoresLanded | None = None) -> list[dict]:
    """The block's requests: warm-ups (the same on every replica), the chains and the sessions one at a
    time, then the concurrency windows through ``send_together`` (a send whose counts come from the
    response, not /metrics deltas; ``send`` when not given). ``wait_for_stores`` (a pool that stores after
    the answer) is awaited before each chain step and session turn, then ``before_step`` (fault injection,
    the page-cache drop) runs before each chain step, with the step's name."""
    rows = []
    for replica in range(replicas):
        for prompt in workload["warmups"]:
            result, counts = await send(replica, prompt)
            rows.append(_row(block, result, counts, replica, prompt, kind="warmup"))
    for item in workload["chains"]:
        for step, role in CHAIN:
            waited = await wait_for_stores() if wait_for_stores else None
            if before_step is not None:
                before_step(step)
            replica = item["replicas"][role]
            result, counts = await send(replica, item["prompt"])
            rows.append(_row(block, result, counts, replica, item["prompt"], kind="chain", context=item["context"],
                             chain=item["chain"], step=step, stores_waited_s=waited,
                             planted_recalled=recalled(result.output_text, item["planted"]) if "planted" in item
                             else None))
    for item in workload["sessions"]:
        prompt = item["first"]
        for turn in range(study["turns"]):
            waited = await wait_for_stores() if wait_for_stores else None
            replica = session_replica(item["placement"], item["session"], turn, replicas)
            result, counts = await send(replica, prompt)
            rows.append(_row(block, result, counts, replica, prompt, kind="session", placement=item["placement"],
                             session=item["session"], turn=turn, context=len(prompt), stores_waited_s=waited))
            if result.error:
                break  # the next turn's prompt needs this answer
            if turn + 1 < study["turns"]:
                prompt = prompt + result.output_token_ids + item["increments"][turn]
    for size in study["windows"]:
        for placement in study["placements"]:
            window = [item for item in workload.get("windows", [])
                      if item["window"] == size and item["placement"] == placement]
            for session_rows in await asyncio.gather(*(_window_session(send_together or send, block, item, study,
                                                                       replicas) for item in window)):
                rows += session_rows
    return rows


async def _window_session(send: Send, block: str, item: dict, study: dict, replicas: int) -> list[dict]:
    """One session of a concurrency window, its turns one after another."""
    rows, prompt = [], item["first"]
    for turn in range(study["window_turns"]):
        replica = session_replica(item["placement"], item["session"], turn, replicas)
        result, counts = await send(replica, prompt)
        rows.append(_row(block, result, counts, replica, prompt, kind="window", window=item["window"],
                         placement=item["placement"], session=item["session"], turn=turn, context=len(prompt)))
        if result.error:
            break
        if turn + 1 < study["window_turns"]:
            prompt = prompt + result.output_token_ids + item["increments"][turn]
    return rows


def chains_agree(chains: pd.DataFrame) -> pd.Series:
    """Per chain (context, chain), whether all of ``chains``' steps gave the same greedy answer."""
    return chains.groupby(["context", "chain"])["output_text"].nunique(dropna=False) == 1


def under_test(rows: pd.DataFrame, batch_invariant: bool = False) -> pd.DataFrame:
    """The requests whose answers the reference must reproduce, keyed by payload: the chains and sessions
    (one at a time), and the concurrency windows only under batch-invariant kernels (a window's requests
    share batches); warm-ups are left out."""
    kinds = ["chain", "session"] + (["window"] if batch_invariant else [])
    return rows[rows["kind"].isin(kinds)].assign(key=lambda frame: frame["payload_sha256"])


def block_checks(rows: pd.DataFrame, arm: str, study: dict, min_hit_fraction: float,
                 reference: pd.DataFrame | None = None, batch_invariant: bool = False) -> dict:
    """Study B's assertions on one block, each failing the block with its reason: no errors; every
    cold step found nothing, locally or in a pool; every cross-replica step found nothing locally, and
    in ON its document's whole chunks in the pool (at least ``min_hit_fraction``), in OFF nothing; in
    ON every answer equal to a pool-less recompute in its split (``reference``, kvpool.measure.reference). An OFF
    block has no pool: its answers are themselves pool-less computations, which the ON blocks'
    reference takes where the splits agree."""
    measured = rows[rows["kind"] != "warmup"]
    chains = measured[measured["kind"] == "chain"]
    cold, cross = chains[chains["step"] == "cold"], chains[chains["step"] == "cross"]
    errors = int(rows["error"].notna().sum())
    cold_hits = cold["local_hit_tokens"].fillna(-1).astype(int) + cold["external_hit_tokens"].fillna(-1).astype(int)
    checks = {
        "zero_errors": check(errors == 0, errors, 0),
        "cold_finds_nothing": check(bool((cold_hits == 0).all()), int(cold_hits.clip(lower=0).sum()), 0),
        "cross_finds_nothing_locally": check(bool((cross["local_hit_tokens"].fillna(-1) == 0).all()),
                                              int(cross["local_hit_tokens"].fillna(0).sum()), 0),
    }
    external = cross["external_hit_tokens"].fillna(0).astype(float)
    if arm == ON:
        fraction = external / cross["context"].astype(float)
        checks["cross_loads_the_document"] = check(bool((fraction >= min_hit_fraction).all() and len(cross)),
                                                    float(fraction.min()) if len(cross) else None, min_hit_fraction)
    else:
        checks["cross_loads_nothing"] = check(bool((external == 0).all()), int(external.sum()), 0)
    planted = chains["planted_recalled"].dropna()
    if len(planted):  # a real model: every chain answer names the three planted codes
        checks["planted_values_recalled"] = check(bool(planted.astype(bool).all()), int(planted.astype(bool).sum()),
                                                   len(planted))
    sessions = measured[measured["kind"] == "session"]
    expected = len(study["placements"]) * study["sessions"] * study["turns"]
    checks["every_turn_answered"] = check(len(sessions) == expected and sessions["error"].isna().all(),
                                           int(sessions["error"].isna().sum()), expected)
    windows = measured[measured["kind"] == "window"]
    if study["windows"]:
        expected = sum(study["windows"]) * len(study["placements"]) * study["window_turns"]
        checks["every_window_turn_answered"] = check(len(windows) == expected and windows["error"].isna().all(),
                                                      int(windows["error"].isna().sum()), expected)
    if arm != ON:
        checks["output_matches_recompute"] = not_applicable(
            "an OFF block has no pool: its answers are themselves pool-less computations (the ON blocks' "
            "reference where their splits agree)")
        return checks
    checks["output_matches_recompute"] = split_reference.output_check(under_test(rows, batch_invariant), reference,
                                                                      "request")
    if len(windows) and not batch_invariant:
        checks["window_outputs_match_recompute"] = outputs_check(windows, reference, max(study["windows"]), False)
    return checks


def answer_agreement(rows: pd.DataFrame) -> dict:
    """How many chains gave one greedy answer at all five steps (cache, pool and compute alike): an
    observation, since the steps compute the prompt in different splits (the reference compares each
    with a recompute in its own split)."""
    agree = chains_agree(rows[rows["kind"] == "chain"])
    return {"chains": len(agree), "agree": int(agree.sum())}


def gate_failures(gate: dict) -> list[str]:
    reasons = [f"block {name} ({block['arm']}): {', '.join(block['failed'])}"
               for name, block in gate["blocks"].items() if not block["valid"]]
    reasons += [f"{name}: {failed['value']} of {failed['threshold']}" for name, failed in gate["checks"].items()
                if status(failed) == FAILED]
    return reasons


log = logging.getLogger(__name__)


@reads("backends", "tiers", "chunk_sizes", "engine", "workload", "replicas")
def run_studyb_workload(config: dict, study: dict, model: str, out: str) -> None:
    """Study B's payloads (``study``: its resolved settings), the same in every block (make_workload)."""
    encode = None
    if config["engine"]["model"]:  # a real model can be asked for planted values (kvpool.studies.studyb.plant)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    workload = make_workload(vocabulary(model), study, config["replicas"], encode)
    write_json(out, workload)
    log.info("Study B: %d chains, %d sessions of %d turns, %d warm-ups", len(workload["chains"]),
             len(workload["sessions"]), study["turns"], len(workload["warmups"]))


def studyb_pool_root(config: dict, study: dict) -> Path:
    """The folder of the ON blocks' pool in the study's tier (each block starts it empty)."""

    return run_pools(config, study["tier"]) / "studyb" / block_cell(study, ON).name


def _fault_in_on_blocks(config: dict, wildcards) -> dict:
    """Only an ON block injects a fault (fault_injection): turning it on re-measures no OFF block. An ON block reads
    its pool's backend's own section too (vllm-fs's store settings)."""
    if not wildcards.block.endswith(f"-{ON}"):
        return {}
    pool = pool_backend(resolved(config)["backend"])
    return {"fault_injection": config["fault_injection"], **pool_sections(config, [pool], besides=PHASE_SETTINGS)}


@reads("backends", "tiers", "chunk_sizes", "engine", "workload", "replicas", *PHASE_SETTINGS, "hash_keys", "lmcache",
       "min_hit_fraction", picked=_fault_in_on_blocks)
def run_studyb_block(config: dict, study: dict, block: str, *, model: str, workload_path: str, plan_out: str,
                     manifest_out: str, csv_out: str, json_out: str, reference_out: str, log_dir: str,
                     known: list[str] = (), provenance_config: dict | None = None) -> None:
    """One of Study B's blocks: its plan (ON, the study's shared pool, empty at the start; OFF, no
    connector), the requests, the block's checks in ``json_out``. An ON block's answers are compared
    with pool-less recomputes in their splits (``reference_out``): the earlier blocks' (``known``: their
    requests.csv, an OFF block's answers being pool-less, and reference.csv), and what none of them has,
    computed after the block's fleet stops."""
    arm = block_arm(block)
    cell = block_cell(study, arm)
    root = studyb_pool_root(config, study)
    plan = checked_ports(new_plan(config, cell, model, Path(plan_out).parent, pool_root=root))
    write_plan(plan, plan_out)
    write_json(manifest_out, provenance.manifest(provenance_config or config, block=block, cell=cell.name))
    workload = read_json(workload_path)
    with unit_pool(config, root, plan):  # independently restarted: nothing of an earlier block's pool is left
        unit, sent, predicted = studyb_block(plan, block, workload, study, config, Path(log_dir))
    frame, meta = with_retrievals(unit.frame, Path(log_dir)), unit.meta
    records.write_records(frame, csv_out, f"studyb-{block}")
    invariant = batch_invariant(config["engine"])
    compared = predicted
    if arm == ON:
        compared = recompute_in_splits(config, model, under_test(frame, invariant), sent,
                                    known_answers(known, OFF), Path(log_dir).parent / "reference")
    compared.to_csv(reference_out, index=False)
    checks = block_checks(frame, arm, study, config["min_hit_fraction"], compared, invariant)
    gate = with_served({"checks": checks, "valid": verdict(checks)}, meta, config["engine"]["max_model_len"],
                       cell.chunk)
    checks = gate["checks"]
    meta.update(arm=arm, cell=cell.name, information={"chain_answers_agree": answer_agreement(frame)}, **gate)
    records.write_meta(meta, json_out)
    for name, result in checks.items():
        if status(result) == "failed":
            log.error("Study B block %s invalid: %s is %s (needs %s)", block, name, result["value"],
                      result["threshold"])


def studyb_block(plan: Plan, block: str, workload: dict, study: dict, cfg: dict, log_dir: Path) -> tuple:
    """One of Study B's blocks (kvpool.studies.studyb) on a fresh fleet and pool (chain_fleet). Returns the
    rows, the block's meta data (wall time, the servers' counters, what fault injection corrupted), the
    prompts sent by payload and, for an OFF block an ON block follows, the ON blocks' predicted pool splits
    computed on its pool-less replicas once its window closed (kvpool.studies.studyb_reference)."""
    injected, before, prompts = [], set(), {}
    fault = cfg.get("fault_injection", {}).get("corrupt_stored_chunk") and any(r.pool_dir for r in plan.replicas)

    async def body(send, send_together, plan, replicas):
        send, send_together = recording_sends(send, prompts), recording_sends(send_together, prompts)

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
                               send_together, stores_landed(plan, cfg, prompts, study["chunk"]))

    predicted = []

    async def reference_for_on_blocks(session, replicas, rows: list[dict]) -> None:
        needed = predicted_pool_splits(records.frame(ChainRecord, rows), study["chunk"])
        requests = split_reference.requests_for(needed, prompts)
        if requests:
            log.info("reference: %d predicted pool splits for the ON blocks, on this block's replica 0", len(requests))
            predicted.extend(await split_reference.compute(session, replicas[0].url, requests,
                                                           cfg["workload"]["output_tokens"],
                                                           cfg["engine"]["request_timeout_s"]))
            for row in predicted:
                row["path"] = PREDICTED

    after = reference_for_on_blocks if block_arm(block) == OFF and ON in SEQUENCE[block_position(block) + 1:] else None
    unit = chain_fleet(plan, cfg, log_dir, body, after=after)
    unit.meta = {"block": block, **unit.meta}
    if fault:
        unit.meta["fault_injection"] = injected
    return unit, prompts, pd.DataFrame(predicted, columns=split_reference.COLUMNS)
