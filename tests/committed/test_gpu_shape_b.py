"""The committed GPU run of Study B's model shape, re-read by the pipeline's own code (issue 52).
docs/results/h100-shape-b: config/h100-shape-b.yaml, a random hybrid 27B (Qwen3.5-27B's language model: 48 Gated
DeltaNet layers and 16 full-attention ones, weights drawn by vLLM, FP8 weights and KV) on two replicas packed on one
H100, Study B's blocks OFF, ON, ON, OFF with LMCache's MP server (RAM) as ON, 32,000-token chains and sessions."""

from pathlib import Path

import pandas as pd
import pytest
from support import REPO, shipped
from support.committed import (
    logged_kv_tokens,
    logged_memory,
    measured_only_rebuild,
    predicted_kv_gib,
    studyb_tables_again,
)

from kvpool.config import validated
from kvpool.engine import shapes
from kvpool.engine.model import build_tokenizer, engine_pool_bytes_per_token
from kvpool.measure import model_check
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records
from kvpool.studies import studyb, studyb_pool

RUN = REPO / "docs" / "results" / "h100-shape-b"
COMMIT = "033e3bf674288c4bbc946b83e8ee0ab56fda514b"
BLOCKS = RUN / "results" / "studyb" / "backend~lmcache-mp" / "chunk~1600" / "tier~ram"
NAMES = ["1-off", "2-on", "3-on", "4-off"]


def block(name: str) -> Path:
    return BLOCKS / f"block~{name}"


def run_config() -> dict:
    return read_json(block("1-off") / "manifest.json")["config"]


@pytest.fixture(scope="module")
def rows() -> pd.DataFrame:
    return pd.concat([read_records(block(name) / "requests.csv") for name in NAMES], ignore_index=True)


def test_every_block_ran_the_hybrid_shape_at_one_clean_commit_on_the_h100_with_vllm_0_26():
    manifests = [read_json(block(name) / "manifest.json") for name in NAMES]
    for manifest in manifests:
        assert manifest["git"] == {"commit": COMMIT, "dirty": False, "source": "KVPOOL_GIT_COMMIT"}
        assert manifest["hardware"]["gpu"]["devices"] == ["NVIDIA H100 80GB HBM3"]
        assert (manifest["versions"]["vllm"], manifest["versions"]["lmcache"]) == ("0.26.0", "0.5.3")
        assert manifest["config"] == manifests[0]["config"]
    config = run_config()
    validated(config, REPO)
    spec, engine = config["random_model"], config["engine"]
    assert (spec["architecture"], spec["weights"], spec["qk_norm_weight"]) == ("qwen3.5", "drawn", 4)
    assert (engine["quantization"], engine["kv_cache_dtype"]) == ("fp8", "fp8")
    assert config["study_b"]["contexts"] == [32000] and config["study_b"]["session_tokens"] == 32000
    # the MP connector carries a hybrid's state only where vLLM snapshots it at every block of the chunk's size
    args = engine["extra_args"]
    assert args[args.index("--mamba-cache-mode") + 1] == "align"
    assert int(args[args.index("--block-size") + 1]) == studyb.resolved(config)["chunk"] == 1600


def test_the_shape_is_the_hybrid_27bs_and_the_logged_page_padding_matches_its_state():
    config = run_config()
    spec = config["random_model"]
    hf = shapes.hf_config(spec, build_tokenizer(spec["vocab_words"]))
    text = hf.text_config
    assert (text.num_hidden_layers, text.num_key_value_heads, text.head_dim, text.vocab_size) == (64, 4, 256, 248320)
    assert shapes.layer_kinds(spec).count("full_attention") == 16
    assert shapes.parameters(hf) == 26_895_998_464  # what the device's model step logged
    assert shapes.kv_bytes_per_token(spec, "bfloat16", config["engine"]["kv_cache_dtype"]) == 32 * 1024
    # vLLM pads each linear layer's state (bfloat16) to an FP8 attention page of 1,600 tokens, and says by how much
    state_per_layer = shapes.state_bytes_per_sequence(spec, "bfloat16") // 48
    page = 1600 * spec["kv_heads"] * spec["head_dim"] * 2
    log = (RUN / "logs" / "studyb" / BLOCKS.relative_to(RUN / "results" / "studyb") / "block~2-on" / "replicas"
           / "replica-0.log").read_text()
    assert f"Padding mamba page size by {100 * (page / state_per_layer - 1):.2f}%" in log


@pytest.mark.parametrize("name", ["2-on", "3-on"])
def test_the_pool_held_every_layers_page_per_chunk_four_times_the_attention_kv(name):
    """LMCache's MP server stores a chunk as all 64 layers' pages: the 16 attention layers' KV and the 48 linear
    layers' state snapshot, padded to the attention page. Its L1 after the block is that, to the byte: 128 KiB a
    token, four times the 32 KiB of KV."""
    config = run_config()
    spec = config["random_model"]
    server = read_json(block(name) / "block.json")["pool_server"]["0"]
    page = 1600 * spec["kv_heads"] * spec["head_dim"] * 2
    chunks = server["metrics"]["lmcache_mp_l1_write_chunks_total"]
    assert chunks > 0 and server["l1_bytes"] == chunks * 64 * page == chunks * 1600 * 128 * 1024
    assert chunks == studyb_pool.pool_chunks(studyb.resolved(config), config) == 68  # what kvpool checks the L1 against
    # what kvpool sizes pools and reads reload rates by
    assert engine_pool_bytes_per_token(config) == 128 * 1024 == 4 * shapes.kv_bytes_per_token(spec, "bfloat16", "fp8")


def test_the_model_check_probed_at_the_chains_length_and_found_the_answers_dependent_on_it():
    recorded = read_json(RUN / "results" / "model-check.json")
    assert recorded["head_tokens"] == model_check.head_tokens(run_config()) == 32000
    again = model_check.verdict(recorded["answers"], [], recorded["head_tokens"])
    assert again["ok"] and again["identical"] and again["distinct_answers"] == 3
    assert {key: recorded[key] for key in again} == again
    argv = recorded["argv"]
    assert argv[argv.index("--model-loader-extra-config") + 1] == '{"qk_norm": 4, "seed": 0, "std": 0.05}'


def test_the_tables_and_the_valid_verdict_come_again_from_the_records(tmp_path):
    gate, page = studyb_tables_again(BLOCKS, NAMES, tmp_path)
    assert gate == read_json(RUN / "results" / "studyb" / "validity.json") and gate["valid"]
    assert page == (RUN / "results" / "studyb.md").read_text()


@pytest.mark.parametrize("name", ["2-on", "3-on"])
def test_every_on_answer_equals_a_recompute_in_its_own_split(name):
    """Where LMCache's MP connector damaged a hybrid's shared-prefix hits (LMCache #4247) every counter stayed
    green; here each ON answer, chains and session turns alike, equals a pool-less recompute in its own split."""
    outputs = read_json(block(name) / "block.json")["checks"]["output_matches_recompute"]
    assert outputs["ok"]
    value = outputs["value"]
    assert value["compared"] == value["exact"] == 17 and value["unmatched"] == value["reference_inconsistent"] == 0


def test_the_cross_step_loaded_the_whole_document_in_on_and_recomputed_it_in_off(rows):
    cross = rows[(rows["kind"] == "chain") & (rows["step"] == "cross")]
    on, off = cross[cross["arm"] == "on"], cross[cross["arm"] == "off"]
    assert len(on) == len(off) == 2
    assert (on["external_hit_tokens"] == 32000).all() and (off["external_hit_tokens"] == 0).all()
    assert off["ttft_s"].median() > 8 * on["ttft_s"].median()  # 3.70 s against 0.427 s
    measured = rows[rows["kind"] != "warmup"]
    assert measured["error"].isna().all()


def test_measured_only_rebuilds_the_page_from_the_committed_records(tmp_path):
    work = measured_only_rebuild(RUN, "h100-shape-b.yaml", "results/studyb.md", "results/studyb.md", tmp_path)
    assert (work / "results" / "studyb.md").read_text() == (RUN / "results" / "studyb.md").read_text()


def test_h100_shape_b_128k_keeps_a_128k_chain_a_replica_by_the_memory_this_run_measured():
    """config/h100-shape-b-128k.yaml (this run's shape and launch at Study B's 128K): at its share of the GPU a
    replica keeps more tokens than its longest request, by the weights, peak activation and memory outside torch
    this run's replicas logged and the tokens a GiB of their pages held, and the second replica's share fits the
    memory free beside the first's."""
    config = shipped("h100-shape-b-128k.yaml")
    engine = config["engine"]
    log = (RUN / "logs" / "model" / "model_check" / "replica-0" / "replica-0.log").read_text()
    gib, measured_share = logged_memory(log)
    tokens_a_gib = logged_kv_tokens(log) / gib["kv"]
    share = engine["gpu_memory_utilization"] / engine["replicas_per_gpu"]
    assert engine["max_model_len"] >= config["study_b"]["contexts"][0] == 131200
    assert predicted_kv_gib(config, gib) * tokens_a_gib > 1.1 * engine["max_model_len"]
    assert predicted_kv_gib(run_config(), gib) == pytest.approx(gib["kv"], abs=0.01)  # the prediction, on this run
    assert share * gib["total"] < gib["free"] - share * gib["total"] - 1.0  # beside the first, a GiB to spare
    assert measured_share < share
