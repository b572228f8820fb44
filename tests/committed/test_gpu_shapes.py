"""The committed GPU runs of Study A's model shape, re-read by the pipeline's own code (issue 52): its Qwen3-30B-A3B
shape (weights drawn by vLLM, FP8 online) on two replicas packed on one H100, 40,960-token documents, both arms.
docs/results/h100-shape-a: config/h100-shape-a.yaml, eight documents, an LMCache MP pool in RAM.
docs/results/h100-shape-a-vllm-fs: config/h100-shape-a-vllm-fs.yaml, six documents, vLLM's own offloading (each
replica's CPU tier and an fs tier of files in /dev/shm).
docs/results/h100-shape-a-reloads: config/h100-shape-a-reloads.yaml, eight documents of three follow-ups each (24
reloads a cell), the MP pool in RAM, the isolated arm's servers emptied before each later follow-up."""

from pathlib import Path

import pandas as pd
import pytest
from support import REPO
from support.committed import assert_same_gate, study_a_cell_dir, study_a_config, study_a_gate_again

from kvpool.cells import Cell
from kvpool.engine import shapes
from kvpool.engine.model import build_tokenizer
from kvpool.measure import model_check
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records

RUN = REPO / "docs" / "results" / "h100-shape-a"
COMMIT = "dce6f14d6bf8fd86a2603b2ee98456eb853a93d3"
CELLS = [Cell("lmcache-mp", arm, 256, "ram") for arm in ("shared", "isolated")]
FS_RUN = REPO / "docs" / "results" / "h100-shape-a-vllm-fs"
FS_COMMIT = "84758299c16f3af96d193b87b6604330a05f0b06"
FS_CELLS = [Cell("vllm-fs", arm, 256, "ram") for arm in ("shared", "isolated")]
RELOADS_RUN = REPO / "docs" / "results" / "h100-shape-a-reloads"
RELOADS_COMMIT = "349b70dd78cccb6e32f6ca38c9a5044a35f78032"
KIB_96 = 96 * 1024


def cell_dir(cell: Cell) -> Path:
    return study_a_cell_dir(RUN, cell)


def run_config() -> dict:
    return study_a_config(RUN, CELLS[0])


def fs_cell_dir(cell: Cell) -> Path:
    return study_a_cell_dir(FS_RUN, cell)


def fs_config() -> dict:
    return study_a_config(FS_RUN, FS_CELLS[0])


def reloads_cell_dir(cell: Cell) -> Path:
    return study_a_cell_dir(RELOADS_RUN, cell)


def reloads_config() -> dict:
    return study_a_config(RELOADS_RUN, CELLS[0])


@pytest.mark.parametrize("cell", CELLS, ids=lambda cell: cell.arm)
def test_each_cell_ran_study_as_shape_at_one_clean_commit_on_the_h100_with_vllm_0_26(cell):
    manifest = read_json(cell_dir(cell) / "manifest.json")
    assert manifest["git"] == {"commit": COMMIT, "dirty": False, "source": "KVPOOL_GIT_COMMIT"}
    assert manifest["hardware"]["gpu"]["devices"] == ["NVIDIA H100 80GB HBM3"]
    assert (manifest["versions"]["vllm"], manifest["versions"]["lmcache"]) == ("0.26.0", "0.5.3")
    # the run predates random_model.qk_norm_weight: today's schema adds its default, the norms as built, as it drew them
    recorded = manifest["config"]
    assert run_config() == {**recorded, "random_model": {**recorded["random_model"], "qk_norm_weight": 1.0}}
    spec, engine = manifest["config"]["random_model"], manifest["config"]["engine"]
    assert (spec["architecture"], spec["weights"], engine["quantization"]) == ("qwen3-moe", "drawn", "fp8")


def test_the_shape_is_qwen3_30b_a3bs_with_96_kib_of_kv_a_token_as_the_pool_server_counted_it():
    config = run_config()
    spec = config["random_model"]
    hf = shapes.hf_config(spec, build_tokenizer(spec["vocab_words"]))
    assert (hf.num_hidden_layers, hf.num_experts, hf.num_experts_per_tok, hf.vocab_size) == (48, 128, 8, 151936)
    assert shapes.parameters(hf) == 30_532_122_624  # what the device's model step logged
    per_token = shapes.kv_bytes_per_token(spec, config["engine"]["dtype"])
    assert per_token == 96 * 1024
    # the MP server's L1 after populate: every document's tokens and the preflight probe's two chunks, at the
    # shape's KV bytes per token to the byte
    gate = read_json(cell_dir(CELLS[0]) / "validity.json")["checks"]
    workload = config["workload"]
    assert gate["pool_bytes"]["value"] == (workload["documents"] * workload["doc_tokens"] + 2 * 256) * per_token


def test_the_model_check_found_the_replicas_alike_and_their_answers_dependent_on_context():
    recorded = read_json(RUN / "results" / "model-check.json")
    # the check then probed 512-token heads; today's probes at the run's 40,960-token documents (check-at-length/)
    assert recorded["head_tokens"] == model_check.HEAD == 512
    again = model_check.verdict(recorded["answers"], [], recorded["head_tokens"])
    assert again["ok"] and again["identical"] and again["distinct_answers"] == 3
    assert {key: recorded[key] for key in again} == again
    argv = recorded["argv"]
    assert argv[argv.index("--load-format") + 1] == "kvpool-random"
    assert argv[argv.index("--quantization") + 1] == "fp8"


def test_the_model_check_again_at_the_documents_length_found_the_answers_dependent_on_them():
    """check-at-length/: the same config's model check alone, at commit 033e3bf (2026-12-07, an H100), which
    probes at the run's longest document: 3 distinct answers of 3 at 40,960-token heads, replicas alike."""
    recorded = read_json(RUN / "check-at-length" / "results" / "model-check.json")
    assert recorded["head_tokens"] == model_check.head_tokens(run_config()) == 40960
    again = model_check.verdict(recorded["answers"], [], recorded["head_tokens"])
    assert again["ok"] and again["identical"] and again["distinct_answers"] == 3
    assert {key: recorded[key] for key in again} == again
    launch = read_json(RUN / "results" / "model-check.json")["argv"]
    assert recorded["argv"] == launch  # the launch the cells' replicas ran, the norms as built (no qk_norm)


@pytest.mark.parametrize("cell", CELLS, ids=lambda cell: cell.arm)
def test_each_cell_is_valid_again_from_its_records(cell, tmp_path):
    recorded, again = study_a_gate_again(RUN, cell, run_config(), tmp_path / "validity.json")
    assert_same_gate(recorded["checks"], again["checks"])
    assert again["valid"] and recorded["valid"]
    outputs = again["checks"]["output_matches_recompute"]["value"]
    assert outputs["exact"] == outputs["equal"] == 8


def test_the_shared_arm_reloaded_every_document_and_the_isolated_arm_recomputed_it():
    doc_tokens = run_config()["workload"]["doc_tokens"]
    shared, isolated = (read_records(cell_dir(cell) / "reuse.csv") for cell in CELLS)
    assert (shared["prefill_replica"] != shared["serve_replica"]).all()
    assert (shared["external_hit_tokens"] == doc_tokens).all() and (shared["local_compute_tokens"] == 256).all()
    assert (isolated["external_hit_tokens"] == 0).all() and (isolated["local_compute_tokens"] >= doc_tokens).all()
    table = pd.read_csv(RUN / "results" / "cell_table.csv").set_index("arm")
    for arm, records in (("shared", shared), ("isolated", isolated)):
        assert table.loc[arm, "ttft_p50_s"] == pytest.approx(records["ttft_s"].median(), rel=1e-12)
        assert table.loc[arm, "ttft_n"] == len(records) == 8
    assert table.loc["isolated", "ttft_p50_ci_low_s"] > 5 * table.loc["shared", "ttft_p50_ci_high_s"]


@pytest.mark.parametrize("cell", FS_CELLS, ids=lambda cell: cell.arm)
def test_vllm_fs_each_cell_ran_the_shipped_config_at_one_clean_commit_on_the_h100_with_vllm_0_26(cell):
    manifest = read_json(fs_cell_dir(cell) / "manifest.json")
    assert manifest["git"] == {"commit": FS_COMMIT, "dirty": False, "source": "KVPOOL_GIT_COMMIT"}
    assert manifest["hardware"]["gpu"]["devices"] == ["NVIDIA H100 80GB HBM3"]
    assert (manifest["versions"]["vllm"], manifest["versions"]["lmcache"]) == ("0.26.0", "0.5.3")
    config = manifest["config"]
    assert config["backends"] == ["vllm-fs"] and config["tiers"] == {"ram": "/dev/shm/kvpool"}
    assert (config["random_model"]["architecture"], config["engine"]["quantization"]) == ("qwen3-moe", "fp8")
    assert config["workload"]["documents"] == 6 and config["workload"]["doc_tokens"] == 40960


def test_vllm_fs_the_model_check_probed_at_the_documents_length_and_found_the_replicas_alike():
    recorded = read_json(FS_RUN / "results" / "model-check.json")
    assert recorded["head_tokens"] == model_check.head_tokens(fs_config()) == 40960
    again = model_check.verdict(recorded["answers"], [], recorded["head_tokens"])
    assert again["ok"] and again["identical"] and again["distinct_answers"] == 3
    assert {key: recorded[key] for key in again} == again


@pytest.mark.parametrize("cell", FS_CELLS, ids=lambda cell: cell.arm)
def test_vllm_fs_each_cell_is_valid_again_from_its_records(cell, tmp_path):
    recorded, again = study_a_gate_again(FS_RUN, cell, fs_config(), tmp_path / "validity.json")
    assert_same_gate(recorded["checks"], again["checks"])
    assert again["valid"] and recorded["valid"]
    outputs = again["checks"]["output_matches_recompute"]["value"]
    assert outputs["exact"] == outputs["equal"] == 6
    # populate's chunk files, read back unchanged after reuse
    unchanged = again["checks"]["pool_unchanged"]["value"]
    assert unchanged["files"] >= 6 * 40960 // 256 and unchanged["changed"] == unchanged["missing"] == 0


def test_vllm_fs_pool_files_hold_every_documents_kv_at_the_shapes_96_kib_a_token():
    config = fs_config()
    per_token = shapes.kv_bytes_per_token(config["random_model"], config["engine"]["dtype"])
    assert per_token == 96 * 1024
    documents = config["workload"]["documents"] * config["workload"]["doc_tokens"] * per_token
    for cell in FS_CELLS:
        pool = read_json(fs_cell_dir(cell) / "populate.json")["pool"]
        assert pool["resident_fraction"] == 1.0 and documents <= pool["bytes"] <= 1.01 * documents


def test_vllm_fs_the_shared_arm_reloaded_every_document_and_the_isolated_arm_recomputed_it():
    doc_tokens = fs_config()["workload"]["doc_tokens"]
    shared, isolated = (read_records(fs_cell_dir(cell) / "reuse.csv") for cell in FS_CELLS)
    assert (shared["prefill_replica"] != shared["serve_replica"]).all()
    assert (shared["external_hit_tokens"] == doc_tokens).all() and (shared["local_compute_tokens"] == 256).all()
    assert (isolated["external_hit_tokens"] == 0).all() and (isolated["local_compute_tokens"] >= doc_tokens).all()
    assert (shared["local_cache_hit_tokens"] == 0).all() and (isolated["local_cache_hit_tokens"] == 0).all()
    table = pd.read_csv(FS_RUN / "results" / "cell_table.csv").set_index("arm")
    for arm, records in (("shared", shared), ("isolated", isolated)):
        assert table.loc[arm, "ttft_p50_s"] == pytest.approx(records["ttft_s"].median(), rel=1e-12)
        assert table.loc[arm, "ttft_n"] == len(records) == 6
    assert table.loc["isolated", "ttft_p50_ci_low_s"] > 4 * table.loc["shared", "ttft_p50_ci_high_s"]


def test_vllm_fs_reloaded_slower_than_the_mp_servers_ram_on_the_same_shape_and_documents():
    """Beside docs/results/h100-shape-a (the MP server's L1, the same shape and 40,960-token documents, an H100 of
    the device tool a day earlier): the intervals of the shared arms' p50s are apart; the isolated arms' overlap."""
    mp = pd.read_csv(REPO / "docs" / "results" / "h100-shape-a" / "results" / "cell_table.csv").set_index("arm")
    fs = pd.read_csv(FS_RUN / "results" / "cell_table.csv").set_index("arm")
    assert fs.loc["shared", "ttft_p50_ci_low_s"] > mp.loc["shared", "ttft_p50_ci_high_s"]
    assert fs.loc["isolated", "ttft_p50_ci_low_s"] < mp.loc["isolated", "ttft_p50_ci_high_s"]
    assert mp.loc["isolated", "ttft_p50_ci_low_s"] < fs.loc["isolated", "ttft_p50_ci_high_s"]


@pytest.mark.parametrize("cell", CELLS, ids=lambda cell: cell.arm)
def test_reloads_each_cell_ran_the_shipped_config_at_one_clean_commit_on_the_h100_with_vllm_0_26(cell):
    manifest = read_json(reloads_cell_dir(cell) / "manifest.json")
    assert manifest["git"] == {"commit": RELOADS_COMMIT, "dirty": False, "source": "KVPOOL_GIT_COMMIT"}
    assert manifest["hardware"]["gpu"]["devices"] == ["NVIDIA H100 80GB HBM3"]
    assert (manifest["versions"]["vllm"], manifest["versions"]["lmcache"]) == ("0.26.0", "0.5.3")
    assert manifest["config"] == reloads_config()
    workload = manifest["config"]["workload"]
    assert (workload["documents"], workload["doc_tokens"], workload["followups_per_document"]) == (8, 40960, 3)


def test_reloads_the_model_check_probed_at_the_documents_length_and_found_the_replicas_alike():
    recorded = read_json(RELOADS_RUN / "results" / "model-check.json")
    assert recorded["head_tokens"] == model_check.head_tokens(reloads_config()) == 40960
    again = model_check.verdict(recorded["answers"], [], recorded["head_tokens"])
    assert again["ok"] and again["identical"] and again["distinct_answers"] == 3
    assert {key: recorded[key] for key in again} == again


@pytest.mark.parametrize("cell", CELLS, ids=lambda cell: cell.arm)
def test_reloads_each_cell_is_valid_again_from_its_records(cell, tmp_path):
    recorded, again = study_a_gate_again(RELOADS_RUN, cell, reloads_config(), tmp_path / "validity.json")
    assert_same_gate(recorded["checks"], again["checks"])
    assert again["valid"] and recorded["valid"]
    outputs = again["checks"]["output_matches_recompute"]["value"]
    assert outputs["exact"] == outputs["equal"] == 24
    # populate: each document's tokens and the preflight probe's two chunks, at the shape's 96 KiB a token
    assert again["checks"]["pool_bytes"]["value"] >= (8 * 40960 + 2 * 256) * KIB_96


def test_reloads_every_shared_follow_up_reloaded_its_document_and_every_isolated_one_recomputed_it():
    shared, isolated = (read_records(reloads_cell_dir(cell) / "reuse.csv") for cell in CELLS)
    for records in (shared, isolated):
        assert len(records) == 24 and (records["prefill_replica"] != records["serve_replica"]).all()
        assert sorted(records.groupby("doc_id")["followup"].apply(sorted).tolist()) == [[0, 1, 2]] * 8
        assert (records["local_cache_hit_tokens"] == 0).all()  # the serving replica's prefix cache was emptied
    assert (shared["external_hit_tokens"] == 40960).all() and (shared["local_compute_tokens"] == 256).all()
    assert (isolated["external_hit_tokens"] == 0).all() and (isolated["local_compute_tokens"] == 40960 + 256).all()
    table = pd.read_csv(RELOADS_RUN / "results" / "cell_table.csv").set_index("arm")
    for arm, records in (("shared", shared), ("isolated", isolated)):
        assert table.loc[arm, "ttft_p50_s"] == pytest.approx(records["ttft_s"].median(), rel=1e-12)
        assert table.loc[arm, "ttft_n"] == 24
    assert table.loc["isolated", "ttft_p50_ci_low_s"] > 4 * table.loc["shared", "ttft_p50_ci_high_s"]


def test_reloads_the_isolated_arm_emptied_both_servers_before_each_later_follow_up_of_a_document():
    """Before follow-ups 1 and 2 of each document (16 times), both MP servers were emptied to 0 bytes. The first
    emptying found populate's four documents a server (and the preflight's two chunks) and, in the serving replica's,
    its recompute of follow-up 0; each later one at most one recompute a server: the document and its 256 new tokens."""
    clears = read_json(reloads_cell_dir(CELLS[1]) / "reuse.json")["clears_between_reloads"]
    assert len(clears) == 16
    assert all(server["bytes_after"] == 0 for clear in clears for server in clear["servers"])
    assert all(clear["stores_settled"]["settled"] for clear in clears)
    recompute, populated = (40960 + 256) * KIB_96, (4 * 40960 + 2 * 256) * KIB_96
    assert sorted(server["bytes_before"] for server in clears[0]["servers"]) == [populated, populated + recompute]
    held = [server["bytes_before"] for clear in clears[1:] for server in clear["servers"]]
    assert set(held) == {0, recompute}


def test_reloads_the_shared_arm_took_longer_than_h100_shape_as_in_its_prefill_step_not_its_load():
    """Beside docs/results/h100-shape-a (one follow-up a document, the same shape, another H100 of the device tool a
    day earlier): the cold recomputes agree (intervals overlap, prefill 1.72 s each), the shared p50s' intervals are
    apart, and of the difference the load (the queue) is 8 ms, the 256 new tokens' prefill step over 100 ms."""
    one = pd.read_csv(RUN / "results" / "cell_table.csv").set_index("arm")
    three = pd.read_csv(RELOADS_RUN / "results" / "cell_table.csv").set_index("arm")
    assert three.loc["shared", "ttft_p50_ci_low_s"] > one.loc["shared", "ttft_p50_ci_high_s"]
    assert three.loc["isolated", "ttft_p50_ci_low_s"] < one.loc["isolated", "ttft_p50_ci_high_s"]
    medians = {name: pd.read_csv(run / "results" / "breakdown.csv").groupby("cell")[["queue", "prefill"]].median()
               for name, run in (("one", RUN), ("three", RELOADS_RUN))}
    shared, isolated = (cell.name for cell in CELLS)
    load = medians["three"].loc[shared, "queue"] - medians["one"].loc[shared, "queue"]
    prefill = medians["three"].loc[shared, "prefill"] - medians["one"].loc[shared, "prefill"]
    assert 0 < load < 0.01 and prefill > 0.1
    assert medians["three"].loc[isolated, "prefill"] == pytest.approx(medians["one"].loc[isolated, "prefill"], abs=0.01)
