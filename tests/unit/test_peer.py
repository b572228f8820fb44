"""The peer replay (kvpool.studies.peer): kvpool's prompts as vllm bench serve's custom dataset, vLLM's own
parser and entry point run for real against a stand-in server, its per-request results read back
into kvpool's records, the replay's gate, and the table beside kvpool's own TTFT."""

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from support import REPO, completions_server

from kvpool.cells import Cell
from kvpool.engine.model import build_tokenizer
from kvpool.measure.records import write_records
from kvpool.report import peer as peer_report
from kvpool.settings import step_settings
from kvpool.studies import load, peer

SHARED = Cell("lmcache-fs", "shared", 256, "disk")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(100).save_pretrained(out)
    return out


def test_the_dataset_carries_the_exact_token_ids_as_text(tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    followups = [[5, 17, 40, 99, 3], [8, 8, 8]]
    lines = peer.dataset(followups, tokenizer, output_tokens=4)
    assert [tokenizer(line["prompt"]).input_ids for line in lines] == followups
    assert {line["output_tokens"] for line in lines} == {4}


def test_a_tokenizer_that_adds_a_bos_token_cannot_carry_kvpools_prompts(tokenizer_dir):
    """The server encodes the dataset's text with special tokens: a BOS token would shift every chunk
    of the document, and the replay would measure a cold prefill instead of a reload."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    with pytest.raises(peer.PeerError, match="follow-up 0: .* does not encode its decoded text back"):
        peer.dataset([[5, 17, 40]], tokenizer, output_tokens=4)


def test_vllms_own_parser_takes_the_arguments_and_they_send_nothing_unmeasured(tmp_path):
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(peer.bench_args("http://127.0.0.1:9", "kvpool-model", "tok", tmp_path / "d.jsonl", 3, 8,
                                             tmp_path, "r.json"))
    # no readiness probe or warm-up (either would leave a document in the replica's own cache), the
    # file's order, one at a time, each request saved
    assert (args.ready_check_timeout_sec, args.num_warmups, args.max_concurrency) == (0, 0, 1)
    assert args.disable_shuffle and args.no_oversample and args.save_detailed and args.skip_chat_template
    assert (args.num_prompts, args.custom_output_len, args.dataset_name) == (3, 8, "custom")


def test_vllm_bench_serve_replays_the_dataset_and_its_records_read_back(tokenizer_dir, tmp_path):
    """vLLM's benchmark client itself, in its own process, against a stand-in server that counts the
    words it was sent: every follow-up arrives whole, in the file's order, and becomes a record."""
    from aiohttp import web
    from transformers import AutoTokenizer

    seen = []

    async def handler(request):
        body = await request.json()
        seen.append(body["prompt"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for word in range(body["max_tokens"]):
            event = {"choices": [{"text": f" w{word}", "index": 0}]}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"].split()),
                                          "completion_tokens": body["max_tokens"]}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return response

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    followups = {4: [10, 11, 12, 13], 6: [20, 21], 2: [30, 31, 32]}
    dataset = tmp_path / "replica-1.jsonl"
    peer.write_dataset(dataset, peer.dataset(list(followups.values()), tokenizer, output_tokens=3))

    async def replay():
        async with completions_server(handler) as url:
            args = peer.bench_args(url, "kvpool-model", str(tokenizer_dir), dataset, len(followups), 3, tmp_path,
                                   "result.json")
            await asyncio.to_thread(peer.run_bench, args, tmp_path / "bench.log", 300, None)

    asyncio.run(replay())
    assert seen == [tokenizer.decode(ids) for ids in followups.values()]  # in order, nothing else sent
    result = peer.read_result(tmp_path / "result.json", len(followups))
    rows = pd.DataFrame(peer.rows(result, list(followups), {4: 0, 6: 0, 2: 0}, serve=1))
    assert rows["doc_id"].tolist() == [4, 6, 2] and (rows["serve_replica"] == 1).all()
    assert rows["prompt_tokens"].tolist() == [4, 2, 3] and (rows["ttft_s"] > 0).all()
    assert (rows["error"] == "").all() and rows["output_text"].tolist() == [" w0 w1 w2"] * 3
    with pytest.raises(peer.PeerError, match="recorded 3 requests, 4 were sent"):
        peer.read_result(tmp_path / "result.json", 4)


def test_a_failing_vllm_bench_serve_names_its_exit_and_log(tmp_path):
    with pytest.raises(peer.PeerError, match="exited with status 2"):
        peer.run_bench(["--no-such-option"], tmp_path / "bench.log", 120, None)
    assert (tmp_path / "bench.log").read_text().startswith("vllm bench serve --no-such-option")


def replay_frame(prompt_tokens=(2304, 2304), errors=("", "")):
    return pd.DataFrame({"doc_id": [0, 1], "prefill_replica": [0, 1], "serve_replica": [1, 0],
                         "prompt_tokens": list(prompt_tokens), "error": list(errors)})


def test_the_replays_gate_takes_its_hits_from_the_window_against_what_reuse_loaded():
    followups = {0: 2304, 1: 2304}
    restored, cold = {"ok": True}, {"ok": True}
    good = peer.checks("shared", replay_frame(), followups, 4096, 4096, restored, cold)
    assert good["valid"] and good["checks"]["pool_hits"]["value"] == 4096
    missed = peer.checks("shared", replay_frame(), followups, 2048, 4096, restored, cold)
    assert not missed["valid"] and not missed["checks"]["pool_hits"]["ok"]
    unknown = peer.checks("shared", replay_frame(), followups, None, 4096, restored, cold)  # /metrics unreachable
    assert not unknown["valid"]
    isolated = peer.checks("isolated", replay_frame(), followups, 0, 0, restored, cold)
    assert isolated["valid"] and "isolation" in isolated["checks"]
    shifted = peer.checks("shared", replay_frame(prompt_tokens=(2305, 2304)), followups, 4096, 4096, restored, cold)
    assert not shifted["valid"] and shifted["checks"]["same_prompts"]["value"] == 1
    failed = peer.checks("shared", replay_frame(errors=("", "HTTP 500")), followups, 4096, 4096, restored, cold)
    assert not failed["valid"] and failed["checks"]["zero_errors"]["value"] == 1


def test_the_peer_row_sets_both_clients_ttft_side_by_side():
    ours = pd.DataFrame({"doc_id": [0, 1, 2, 3], "ttft_s": [0.20, 0.22, 0.24, 9.0], "error": ["", "", "", "timeout"]})
    theirs = pd.DataFrame({"doc_id": [3, 2, 1, 0], "ttft_s": [0.26, 0.25, 0.23, 0.21], "error": ["", "", "", ""]})
    row = peer.peer_row(SHARED, ours, theirs, True, True)
    assert row["kvpool_ttft_p50_s"] == pytest.approx(0.22) and row["vllm_ttft_p50_s"] == pytest.approx(0.24)
    assert row["p50_difference_pct"] == pytest.approx(100 * (0.24 / 0.22 - 1))
    assert row["valid"] and row["requests"] == 4
    # paired by document (the failed one left out): +5%, +4.5%, +4.2%
    assert row["paired_requests"] == 3 and row["paired_median_change_pct"] == pytest.approx(100 * (0.23 / 0.22 - 1))
    assert row["paired_median_change_ci_low_pct"] <= row["paired_median_change_pct"] <= \
        row["paired_median_change_ci_high_pct"]
    assert not peer.peer_row(SHARED, ours, theirs, True, False)["valid"]
    table = peer_report.peer_markdown(pd.DataFrame([row]))
    assert "lmcache-fs / shared / chunk 256 / disk" in table and "+9.1%" in table


def test_the_peer_replay_is_the_last_unit_of_a_cells_chain(config):
    config["load"].update(concurrency=[1, 4], rates=[0.5])
    config["peer"]["enabled"] = True
    # first, right after the reuse phase it replays: a load level added later is appended after it
    assert [level.name for level in load.load_chain(config)] == ["peer", "c4", "r0.5"]
    assert load.Level.from_name("peer").kind == "peer"
    config["peer"]["enabled"] = False
    assert [level.name for level in load.load_chain(config)] == ["c4", "r0.5"]
    assert np.isnan(peer.rows({"ttfts": [None], "errors": ["boom"], "latencies": [None], "input_lens": [0]},
                              [3], {3: 0}, 1)[0]["ttft_s"])


def test_peer_arms_keep_the_replay_off_the_other_arms_chain(config):
    config["load"].update(concurrency=[4], rates=[])
    config["peer"].update(enabled=True, arms=["shared"])
    isolated = Cell("lmcache-fs", "isolated", 256, "disk")
    assert [level.name for level in load.load_chain(config, SHARED)] == ["peer", "c4"]
    assert [level.name for level in load.load_chain(config, isolated)] == ["c4"]
    assert [level.name for level in load.load_chain(config)] == ["peer", "c4"]  # what any cell runs


def test_the_peer_config_replays_the_shared_cell_alone_and_the_next_cell_waits_for_that_replay(tmp_path):
    """config/peer.yaml, the default with the replay (peer.arms [shared]): one peer replay, the shared cell's,
    right after its reuse. With keep_pools false the tier holds one cell's pool, removed by the last unit on it:
    the shared cell's replay, so the isolated cell populates after it (and, replayed by no one, removes its pool
    in its reuse)."""
    result = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-s", str(REPO / "Snakefile"), "--directory",
                             str(tmp_path), "--configfile", str(REPO / "config" / "peer.yaml"),
                             "--config", "keep_pools=False"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    replays = re.findall(r"output: (results/cells/\S+)/load~peer/manifest.json", result.stdout)
    assert replays == ["results/cells/backend~lmcache-fs/arm~shared/chunk~256/tier~disk"]
    replay = re.search(r"input: (.*)\n\s+output: \S+/load~peer/manifest.json", result.stdout)
    assert f"{replays[0]}/reuse.json" in replay.group(1)
    populate = re.search(r"input: (.*)\n\s+output: results/cells/backend~lmcache-fs/arm~isolated/\S+/populate.csv",
                         result.stdout)
    assert "arm~shared/chunk~256/tier~disk/load~peer/level.json" in populate.group(1)


def test_a_result_without_latencies_takes_ttft_plus_the_token_gaps():
    """vLLM 0.26 (the H200's) saves no per-request ``latencies``; vLLM 0.32 (the CPU default's) saves
    both. The H200 replay's own saved result: each request's end-to-end time is its TTFT plus its
    inter-token gaps, and where both are saved the two agree."""
    run = (Path(__file__).resolve().parents[2] / "docs" / "results" / "h200-mp-peer" / "results" / "cells"
           / "backend~lmcache-mp" / "arm~shared" / "chunk~256" / "tier~ram" / "load~peer")
    result = peer.read_result(run / "vllm-bench-replica-1.json", 32)
    assert "latencies" not in result
    rows = pd.DataFrame(peer.rows(result, list(range(32)), dict.fromkeys(range(32), 0), serve=1))
    gaps = [sum(itl) for itl in result["itls"]]
    assert rows["e2e_s"].tolist() == pytest.approx([t + g for t, g in zip(result["ttfts"], gaps, strict=True)])
    assert (rows["e2e_s"] > rows["ttft_s"]).all()
    # the mean end-to-end time vLLM itself reported for the run is the mean of these
    assert rows["e2e_s"].mean() * 1000 == pytest.approx(result["mean_e2el_ms"], rel=1e-3)
    newer = dict(result, latencies=[t + g for t, g in zip(result["ttfts"], gaps, strict=True)])
    assert peer.rows(newer, [0], {0: 0}, 1)[0]["e2e_s"] == pytest.approx(rows["e2e_s"][0])


def test_the_peer_table_splits_each_cell_by_serving_replica():
    """The replay runs one replica's follow-ups after the other's: a slow run on one replica shows in its
    own row, while the cell's row pools both."""
    ours = pd.DataFrame({"doc_id": [0, 1, 2, 3], "serve_replica": [1, 0, 1, 0], "ttft_s": [0.10, 0.10, 0.10, 0.10],
                         "error": [""] * 4})
    theirs = pd.DataFrame({"doc_id": [1, 3, 0, 2], "serve_replica": [0, 0, 1, 1], "ttft_s": [0.15, 0.15, 0.10, 0.10],
                           "error": [""] * 4})
    rows = pd.DataFrame(peer.peer_rows(SHARED, ours, theirs, True, True)).set_index("replica")
    assert rows.index.tolist() == ["all", "0", "1"] and rows["requests"].tolist() == [4, 2, 2]
    assert rows.loc["0", "p50_difference_pct"] == pytest.approx(50.0)
    assert rows.loc["1", "p50_difference_pct"] == pytest.approx(0.0)
    assert rows.loc["all", "paired_median_change_pct"] == pytest.approx(25.0)  # the median of 0, 0, 50, 50
    text = peer_report.peer_markdown(rows.reset_index())
    head, per_replica = text.split("## Per serving replica")
    assert head.count("lmcache-fs / shared") == 1 and per_replica.count("lmcache-fs / shared") == 2
    assert "+50.0%" in per_replica and "+50.0%" not in head


def test_each_replica_order_is_a_unit_of_its_own_and_adding_one_re_runs_no_other(config):
    """peer.orders: the serving replicas' runs in index order (load~peer, as before) and reversed
    (load~peer-descending), so a slow first run is told apart from a slow replica."""
    config["load"].update(concurrency=[4], rates=[])
    config["peer"].update(enabled=True, arms=["shared"])
    job = SimpleNamespace(backend="lmcache-fs", level="peer")
    before = step_settings(load.run_load_level, config, job)
    config["peer"]["orders"] = ["ascending", "descending"]
    assert [level.name for level in load.load_chain(config, SHARED)] == ["peer", "peer-descending", "c4"]
    assert load.Level.from_name("peer-descending") == load.Level("peer", 1, "descending")
    assert re.fullmatch(load.LEVEL_PATTERN, "peer-descending") and not re.fullmatch(load.LEVEL_PATTERN, "peer-up")
    with pytest.raises(ValueError, match="peer-sideways"):
        load.Level.from_name("peer-sideways")
    assert step_settings(load.run_load_level, config, job) == before
    route, workload = {0: 1, 1: 0, 2: 1}, [{"doc_id": d} for d in range(3)]
    assert peer.serving_order(route, workload, "ascending") == [0, 1]
    assert peer.serving_order(route, workload, "descending") == [1, 0]


def test_the_peer_table_names_each_rows_order_where_both_ran(tmp_path):
    ours = pd.DataFrame({"doc_id": [0, 1], "serve_replica": [1, 0], "ttft_s": [0.10, 0.10], "error": [""] * 2,
                         "output_text": ["a", "b"]})
    files = {}
    for unit, slow in (("peer", 0), ("peer-descending", 1)):
        theirs = ours.assign(ttft_s=[0.2 if r == slow else 0.1 for r in ours["serve_replica"]])
        files[(SHARED, unit)] = {"csv": str(tmp_path / f"replay-{unit}.csv"), "meta": str(tmp_path / f"{unit}.json")}
        write_records(theirs, files[(SHARED, unit)]["csv"], unit)
        (tmp_path / f"{unit}.json").write_text(json.dumps({"valid": True}))
    write_records(ours, str(tmp_path / "reuse.csv"), "reuse")
    (tmp_path / "validity.json").write_text(json.dumps({"valid": True}))
    reuse = {SHARED: {"csv": str(tmp_path / "reuse.csv"), "validity": str(tmp_path / "validity.json")}}
    out = {"csv_out": str(tmp_path / "peer.csv"), "md_out": str(tmp_path / "peer.md")}
    peer_report.run_peer_table([(SHARED, "peer")], reuse=reuse, replays=files, **out)
    assert "order" not in pd.read_csv(tmp_path / "peer.csv").columns  # one order: the table as it was
    peer_report.run_peer_table(list(files), reuse=reuse, replays=files, **out)
    table = pd.read_csv(tmp_path / "peer.csv", dtype={"replica": str}).set_index(["order", "replica"])
    assert table.loc[("ascending", "0"), "p50_difference_pct"] == pytest.approx(100.0)
    assert table.loc[("descending", "1"), "p50_difference_pct"] == pytest.approx(100.0)
    assert table.loc[("descending", "0"), "p50_difference_pct"] == pytest.approx(0.0)
    assert "replica order" in (tmp_path / "peer.md").read_text()
