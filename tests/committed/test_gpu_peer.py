"""The committed H200 replay through vLLM's own client (docs/results/h200-mp-peer: two replicas packed on
one H200, the 7.1B random Llama, 64 documents of 8,192 tokens, LMCache's MP server with a host-RAM L1,
the shared cell), re-read by the pipeline's own code: the replay's gate and hits, the table again from
the records, and the README's account of why the two clients' p50s differ."""

import re
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from support.committed import assert_peer_table_rebuilt

from kvpool.cells import Cell
from kvpool.measure import reuse_checks
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records
from kvpool.studies import peer

RUN = Path(__file__).resolve().parents[2] / "docs" / "results" / "h200-mp-peer"
CELL = Cell("lmcache-mp", "shared", 256, "ram")
FOLDER = RUN / "results" / "cells" / CELL.name
OUTPUT_TOKENS = 8


def records() -> tuple[pd.DataFrame, pd.DataFrame]:
    return read_records(str(FOLDER / "reuse.csv")), read_records(str(FOLDER / "load~peer" / "requests.csv"))


def test_the_cell_and_its_replay_are_valid_and_the_replay_loaded_what_reuse_loaded():
    manifest = read_json(FOLDER / "manifest.json")
    assert manifest["git"]["commit"] == "fe7964e6e09f0a364b29399d530ba695282f9253"
    assert manifest["versions"]["vllm"] == "0.26.0" and manifest["hardware"]["gpu"]["devices"] == ["NVIDIA H200"]
    validity, replay = read_json(FOLDER / "validity.json"), read_json(FOLDER / "load~peer" / "level.json")
    assert validity["valid"] and validity["checks"]["output_matches_recompute"]["value"] == 64
    assert replay["valid"] and replay["pool_restore"]["bytes"] == replay["pool_restore"]["cell_bytes"]
    reused, replayed = records()
    assert replay["checks"]["pool_hits"]["value"] == reused["external_hit_tokens"].sum() == 64 * 8192
    assert dict(zip(replayed["doc_id"], replayed["serve_replica"], strict=True)) == dict(
        zip(reused["doc_id"], reused["serve_replica"], strict=True)
    )
    # the reference the gate compared with is the load run's: the same model seed and prompts
    reference = RUN.parent / "h200-mp-load-arms" / "results" / "reference" / "outputs.csv"
    assert (RUN / "results" / "reference" / "outputs.csv").read_bytes() == reference.read_bytes()


def test_vllms_client_got_the_split_matched_recomputes_answers():
    """Today's replay gate holds vLLM's client's answers (its saved generated texts) to the reference in each
    follow-up's split, taken from kvpool's reuse of the same follow-up on the same pool: 64 of 64 equal."""
    reused, replayed = records()
    reference = read_records(str(RUN / "results" / "reference" / "outputs.csv"))
    outputs = reuse_checks.outputs_check(peer.with_reuse_splits(replayed, reused), reference, 1, batch_invariant=False)
    assert outputs["status"] == "passed" and outputs["value"]["exact"] == outputs["value"]["equal"] == 64


def test_the_table_rebuilds_from_the_records(tmp_path):
    assert_peer_table_rebuilt(RUN, CELL, tmp_path)


def test_the_clients_differ_by_one_replicas_run_and_there_decode_is_slow_too():
    """The cell misses the 5% target (+20.7% at p50). Replica 1's follow-ups are within it (-3.9%);
    replica 0's run, the replay's first, is +62%. Its decode gaps are twice replica 1's and kvpool's
    too: the replica served slower in that run, which no difference in how a client times the
    first token explains."""
    table = pd.read_csv(RUN / "results" / "peer.csv", dtype={"replica": str}).set_index("replica")
    assert table.loc["all", "p50_difference_pct"] > 5
    assert abs(table.loc["1", "p50_difference_pct"]) < 5 and table.loc["0", "p50_difference_pct"] > 50
    reused, _ = records()
    ours = (reused["e2e_s"] - reused["ttft_s"]) / (OUTPUT_TOKENS - 1)
    theirs = {}
    for replica in (0, 1):
        result = peer.read_result(FOLDER / "load~peer" / f"vllm-bench-replica-{replica}.json", 32)
        theirs[replica] = float(np.median([np.mean(gaps) for gaps in result["itls"]]))
        assert ours[reused["serve_replica"] == replica].median() == pytest.approx(0.020, abs=0.002)
    assert theirs[1] == pytest.approx(0.016, abs=0.002) and theirs[0] > 1.8 * theirs[1]


def pool_server_prefill_s(log: Path, since: str, until: str) -> float:
    """The median time from the pool server's answer to a request's lookup ("Prefetch request
    completed") to its store of the new follow-up tokens ("Stored 256 tokens"), which the replica
    sends after its prefill: the replica's own time, as the pool server's log records it."""
    spans, prefetched = [], None
    for line in log.read_text(errors="replace").splitlines():
        found = re.search(
            r"\[(\d{4}-\d\d-\d\d (\d\d:\d\d:\d\d),\d+)\] LMCache INFO:\S* (Prefetch request completed|"
            r"Stored 256 tokens)",
            re.sub(r"\x1b\[[0-9;]*m", "", line),
        )
        if not found or not since <= found.group(2) <= until:
            continue
        at = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f")
        if found.group(3).startswith("Prefetch"):
            prefetched = at
        elif prefetched is not None:
            spans.append((at - prefetched).total_seconds())
            prefetched = None
    assert len(spans) >= 30
    return float(np.median(spans))


def test_the_pool_servers_log_puts_the_slow_run_in_the_replica():
    """The pool server saw replica 0's replay run take longer from its lookup to its store than the
    replica 1 run after it or kvpool's reuse phase, so the extra time was spent in the replica."""
    logs = RUN / "logs"
    replay = logs / "load" / CELL.name / "load~peer" / "servers" / "lmcache-server-0.log"
    reuse = logs / "memory_pool_cell" / CELL.name / "servers" / "lmcache-server-0.log"
    first, second = (
        pool_server_prefill_s(replay, "15:18:30", "15:18:47"),
        pool_server_prefill_s(replay, "15:19:05", "15:19:17"),
    )
    ours = pool_server_prefill_s(reuse, "15:00:46", "15:01:07")
    assert first > 1.3 * second and first > 1.3 * ours
    assert second == pytest.approx(ours, rel=0.2)
