"""The committed GPU runs of Study A's model shape, re-read by the pipeline's own code (issue 52): its Qwen3-30B-A3B
shape (weights drawn by vLLM, FP8 online) on two replicas packed on one H100, 40,960-token documents, both arms.
docs/results/h100-shape-a: config/h100-shape-a.yaml, eight documents, an LMCache MP pool in RAM.
docs/results/h100-shape-a-vllm-fs: config/h100-shape-a-vllm-fs.yaml, six documents, vLLM's own offloading (each
replica's CPU tier and an fs tier of files in /dev/shm).
docs/results/h100-shape-a-reloads: config/h100-shape-a-reloads.yaml, eight documents of three follow-ups each (24
reloads a cell), the MP pool in RAM, the isolated arm's servers emptied before each later follow-up.
docs/results/h100-shape-a-99k: config/h100-shape-a-99k.yaml, Study A's 99,072-token documents with the KV in FP8, four
documents of five follow-ups each (20 reloads a cell), the MP pool in RAM, emptied as in the reloads run."""

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
from support import REPO, shipped
from support.committed import (
    assert_same_gate,
    logged_kv_tokens,
    logged_memory,
    predicted_kv_gib,
    study_a_cell_dir,
    study_a_config,
    study_a_gate_again,
)

from kvpool.cells import Cell
from kvpool.engine import shapes
from kvpool.engine.model import build_tokenizer
from kvpool.measure import model_check
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records

KIB_96, KIB_48 = 96 * 1024, 48 * 1024
DOC_TOKENS = 40960


@dataclass(frozen=True)
class ShapeRun:
    """One committed run of the shape: its folder, the commit it ran at, its pool, documents and follow-ups."""

    folder: str
    commit: str
    backend: str
    documents: int
    followups_per_document: int
    doc_tokens: int = DOC_TOKENS
    kv_bytes_per_token: int = KIB_96

    @property
    def path(self) -> Path:
        return REPO / "docs" / "results" / self.folder

    @property
    def followups(self) -> int:
        return self.documents * self.followups_per_document

    def cell(self, arm: str) -> Cell:
        return Cell(self.backend, arm, 256, "ram")

    def cell_dir(self, arm: str) -> Path:
        return study_a_cell_dir(self.path, self.cell(arm))

    def config(self) -> dict:
        return study_a_config(self.path, self.cell("shared"))

    def replica_log(self, replica: int) -> str:
        """A replica's vLLM log in the shared cell."""
        replicas = self.path / "logs" / "cell" / self.cell("shared").name / "replicas"
        return (replicas / f"replica-{replica}.log").read_text()

    def table(self) -> pd.DataFrame:
        return pd.read_csv(self.path / "results" / "cell_table.csv").set_index("arm")


MP = ShapeRun("h100-shape-a", "dce6f14d6bf8fd86a2603b2ee98456eb853a93d3", "lmcache-mp", 8, 1)
FS = ShapeRun("h100-shape-a-vllm-fs", "84758299c16f3af96d193b87b6604330a05f0b06", "vllm-fs", 6, 1)
RELOADS = ShapeRun("h100-shape-a-reloads", "349b70dd78cccb6e32f6ca38c9a5044a35f78032", "lmcache-mp", 8, 3)
A99K = ShapeRun("h100-shape-a-99k", "c5101955f2ca75c018a5e02e5935748c9d8d9f02", "lmcache-mp", 4, 5, doc_tokens=99072,
                kv_bytes_per_token=KIB_48)
RUNS = [MP, FS, RELOADS, A99K]
EMPTIED = pytest.mark.parametrize("run", [RELOADS, A99K], ids=[RELOADS.folder, A99K.folder])
ARMS = ("shared", "isolated")
EACH_CELL = pytest.mark.parametrize(("run", "arm"), [(run, arm) for run in RUNS for arm in ARMS],
                                    ids=[f"{run.folder}-{arm}" for run in RUNS for arm in ARMS])
EACH_RUN = pytest.mark.parametrize("run", RUNS, ids=[run.folder for run in RUNS])


@EACH_CELL
def test_each_cell_ran_its_config_at_one_clean_commit_on_the_h100_with_vllm_0_26(run, arm):
    manifest = read_json(run.cell_dir(arm) / "manifest.json")
    assert manifest["git"] == {"commit": run.commit, "dirty": False, "source": "KVPOOL_GIT_COMMIT"}
    assert manifest["hardware"]["gpu"]["devices"] == ["NVIDIA H100 80GB HBM3"]
    assert (manifest["versions"]["vllm"], manifest["versions"]["lmcache"]) == ("0.26.0", "0.5.3")
    # h100-shape-a predates random_model.qk_norm_weight: today's schema adds its default, the norms as built
    recorded = manifest["config"]
    assert run.config() == {**recorded, "random_model": {**recorded["random_model"], "qk_norm_weight": 1.0}}
    spec, engine, workload = recorded["random_model"], recorded["engine"], recorded["workload"]
    assert (spec["architecture"], spec["weights"], engine["quantization"]) == ("qwen3-moe", "drawn", "fp8")
    assert recorded["backends"] == [run.backend] and recorded["tiers"] == {"ram": "/dev/shm/kvpool"}
    assert (workload["documents"], workload["doc_tokens"]) == (run.documents, run.doc_tokens)
    assert workload.get("followups_per_document", 1) == run.followups_per_document


@pytest.mark.parametrize(("run", "found"), [(MP, MP.path / "check-at-length"), (FS, FS.path), (RELOADS, RELOADS.path),
                                            (A99K, A99K.path)],
                         ids=["h100-shape-a-again", FS.folder, RELOADS.folder, A99K.folder])
def test_the_model_check_at_the_documents_length_found_the_replicas_alike_and_the_answers_dependent_on_them(run, found):
    """Two replicas of the reference launch gave identical answers to 3 cold prompts with heads of their own as long
    as a document, 3 distinct answers of 3 (h100-shape-a's own check probed 512-token heads; check-at-length/ is the
    same config's check alone, at commit 033e3bf, 2026-12-07)."""
    recorded = read_json(found / "results" / "model-check.json")
    assert recorded["head_tokens"] == model_check.head_tokens(run.config()) == run.doc_tokens
    again = model_check.verdict(recorded["answers"], [], recorded["head_tokens"])
    assert again["ok"] and again["identical"] and again["distinct_answers"] == 3
    assert {key: recorded[key] for key in again} == again
    argv = recorded["argv"]
    assert argv[argv.index("--load-format") + 1] == "kvpool-random"
    assert argv[argv.index("--quantization") + 1] == "fp8"


@EACH_CELL
def test_each_cell_is_valid_again_from_its_records(run, arm, tmp_path):
    recorded, again = study_a_gate_again(run.path, run.cell(arm), run.config(), tmp_path / "validity.json")
    assert_same_gate(recorded["checks"], again["checks"])
    assert again["valid"] and recorded["valid"]
    outputs = again["checks"]["output_matches_recompute"]["value"]
    assert outputs["exact"] == outputs["equal"] == run.followups


@EACH_RUN
def test_every_shared_follow_up_reloaded_its_document_and_every_isolated_one_recomputed_it(run):
    shared, isolated = (read_records(run.cell_dir(arm) / "reuse.csv") for arm in ARMS)
    for records in (shared, isolated):
        assert len(records) == run.followups and (records["prefill_replica"] != records["serve_replica"]).all()
        assert (records["local_cache_hit_tokens"] == 0).all()  # nothing from the serving replica's own cache
        assert sorted(records.groupby("doc_id")["followup"].apply(sorted).tolist()) == (
            [list(range(run.followups_per_document))] * run.documents)
    assert (shared["external_hit_tokens"] == run.doc_tokens).all() and (shared["local_compute_tokens"] == 256).all()
    assert (isolated["external_hit_tokens"] == 0).all() and (isolated["local_compute_tokens"] >= run.doc_tokens).all()
    table = run.table()
    for arm, records in zip(ARMS, (shared, isolated), strict=True):
        assert table.loc[arm, "ttft_p50_s"] == pytest.approx(records["ttft_s"].median(), rel=1e-12)
        assert table.loc[arm, "ttft_n"] == run.followups
    assert table.loc["isolated", "ttft_p50_ci_low_s"] > 4 * table.loc["shared", "ttft_p50_ci_high_s"]


@pytest.mark.parametrize("run", [MP, RELOADS, A99K], ids=[MP.folder, RELOADS.folder, A99K.folder])
def test_the_shape_is_qwen3_30b_a3bs_with_its_kv_bytes_a_token_as_the_pool_server_counted_it(run):
    """96 KiB a token with the KV in bfloat16, 48 KiB in FP8 (h100-shape-a-99k)."""
    config = run.config()
    spec = config["random_model"]
    hf = shapes.hf_config(spec, build_tokenizer(spec["vocab_words"]))
    assert (hf.num_hidden_layers, hf.num_experts, hf.num_experts_per_tok, hf.vocab_size) == (48, 128, 8, 151936)
    assert shapes.parameters(hf) == 30_532_122_624  # what the device's model step logged
    engine = config["engine"]
    per_token = shapes.kv_bytes_per_token(spec, engine["dtype"], engine.get("kv_cache_dtype", "auto"))
    assert per_token == run.kv_bytes_per_token
    # the MP server's L1 after populate: every document's tokens and the preflight probe's two chunks, at the
    # shape's KV bytes per token to the byte
    gate = read_json(run.cell_dir("shared") / "validity.json")["checks"]
    assert gate["pool_bytes"]["value"] == (run.documents * run.doc_tokens + 2 * 256) * per_token


def test_h100_shape_as_own_model_check_probed_512_token_heads_with_the_launch_checked_again_at_length():
    recorded = read_json(MP.path / "results" / "model-check.json")
    assert recorded["head_tokens"] == model_check.HEAD == 512
    again = model_check.verdict(recorded["answers"], [], recorded["head_tokens"])
    assert again["ok"] and again["identical"] and again["distinct_answers"] == 3
    assert {key: recorded[key] for key in again} == again
    at_length = read_json(MP.path / "check-at-length" / "results" / "model-check.json")
    assert at_length["argv"] == recorded["argv"]  # the launch the cells' replicas ran, the norms as built


def test_vllm_fs_pool_files_hold_every_documents_kv_at_the_shapes_96_kib_a_token_and_were_read_back_unchanged():
    documents = FS.documents * DOC_TOKENS * KIB_96
    for arm in ARMS:
        pool = read_json(FS.cell_dir(arm) / "populate.json")["pool"]
        assert pool["resident_fraction"] == 1.0 and documents <= pool["bytes"] <= 1.01 * documents
        # populate's chunk files, read back unchanged after reuse (the gate's record; judged again above)
        unchanged = read_json(FS.cell_dir(arm) / "validity.json")["checks"]["pool_unchanged"]["value"]
        assert unchanged["files"] >= FS.documents * DOC_TOKENS // 256
        assert unchanged["changed"] == unchanged["missing"] == 0


def test_vllm_fs_reloaded_slower_than_the_mp_servers_ram_on_the_same_shape_and_documents():
    """Beside docs/results/h100-shape-a (the MP server's L1, the same shape and 40,960-token documents, an H100 of
    the device tool a day earlier): the intervals of the shared arms' p50s are apart; the isolated arms' overlap."""
    mp, fs = MP.table(), FS.table()
    assert fs.loc["shared", "ttft_p50_ci_low_s"] > mp.loc["shared", "ttft_p50_ci_high_s"]
    assert fs.loc["isolated", "ttft_p50_ci_low_s"] < mp.loc["isolated", "ttft_p50_ci_high_s"]
    assert mp.loc["isolated", "ttft_p50_ci_low_s"] < fs.loc["isolated", "ttft_p50_ci_high_s"]


@EMPTIED
def test_the_isolated_arm_emptied_both_servers_before_each_later_follow_up_of_a_document(run):
    """Before each later follow-up of a document (16 times in both runs), both MP servers were emptied to 0 bytes. The
    first emptying found populate's documents in each server (half of them a server, and the preflight's two chunks)
    and, in the serving replica's, its recompute of follow-up 0; each later one at most one recompute a server: the
    document and its 256 new tokens, at the run's KV bytes a token."""
    clears = read_json(run.cell_dir("isolated") / "reuse.json")["clears_between_reloads"]
    assert len(clears) == run.documents * (run.followups_per_document - 1) == 16
    assert all(server["bytes_after"] == 0 for clear in clears for server in clear["servers"])
    assert all(clear["stores_settled"]["settled"] for clear in clears)
    recompute = (run.doc_tokens + 256) * run.kv_bytes_per_token
    populated = (run.documents // 2 * run.doc_tokens + 2 * 256) * run.kv_bytes_per_token
    assert sorted(server["bytes_before"] for server in clears[0]["servers"]) == [populated, populated + recompute]
    held = [server["bytes_before"] for clear in clears[1:] for server in clear["servers"]]
    assert set(held) == {0, recompute}
    assert read_json(run.cell_dir("isolated") / "validity.json")["checks"]["isolation"]["value"] == 0


def test_reloads_the_shared_arm_took_longer_than_h100_shape_as_in_its_prefill_step_not_its_load():
    """Beside docs/results/h100-shape-a (one follow-up a document, the same shape, another H100 of the device tool a
    day earlier): the cold recomputes agree (intervals overlap, prefill 1.72 s each), the shared p50s' intervals are
    apart, and of the difference the load (the queue) is 8 ms, the 256 new tokens' prefill step over 100 ms."""
    one, three = MP.table(), RELOADS.table()
    assert three.loc["shared", "ttft_p50_ci_low_s"] > one.loc["shared", "ttft_p50_ci_high_s"]
    assert three.loc["isolated", "ttft_p50_ci_low_s"] < one.loc["isolated", "ttft_p50_ci_high_s"]
    medians = {run.folder: pd.read_csv(run.path / "results" / "breakdown.csv").groupby("cell")[["queue", "prefill"]]
               .median() for run in (MP, RELOADS)}
    one, three = medians[MP.folder], medians[RELOADS.folder]
    shared, isolated = (MP.cell(arm).name for arm in ARMS)
    assert 0 < three.loc[shared, "queue"] - one.loc[shared, "queue"] < 0.01
    assert three.loc[shared, "prefill"] - one.loc[shared, "prefill"] > 0.1
    assert three.loc[isolated, "prefill"] == pytest.approx(one.loc[isolated, "prefill"], abs=0.01)


def test_h100_shape_a_99k_keeps_a_99k_document_of_fp8_kv_a_replica_by_the_memory_the_reloads_run_measured():
    """config/h100-shape-a-99k.yaml (Study A's 99K documents on an H100, KV in FP8): at its share of the GPU a replica
    keeps the KV of its longest request, by what vLLM logged for the same shape and launch on an H100 (weights, peak
    activation, memory outside torch), and the second replica's share fits the memory free when it started."""
    config = shipped("h100-shape-a-99k.yaml")
    engine = config["engine"]
    gib, measured_share = replica_memory(RELOADS, 1)
    share = engine["gpu_memory_utilization"] / engine["replicas_per_gpu"]
    kv = predicted_kv_gib(config, gib)
    per_token = shapes.kv_bytes_per_token(config["random_model"], engine["dtype"], engine["kv_cache_dtype"])
    assert per_token == KIB_48
    assert engine["max_model_len"] * per_token < 0.95 * kv * 2**30
    # replica-1 started beside replica-0's share: this config's second replica finds that much less free
    assert share * gib["total"] < gib["free"] - (share - measured_share) * gib["total"]


@pytest.mark.parametrize("replica", [0, 1])
def test_h100_shape_a_99k_replicas_kept_the_kv_the_reloads_run_predicted_for_them(replica):
    """The 99K run's replicas (its shared cell's) logged the KV memory predicted above from the reloads run, and held
    more tokens of it than their longest request."""
    config = A99K.config()
    engine = config["engine"]
    gib, share = replica_memory(A99K, replica)
    assert share == engine["gpu_memory_utilization"] / engine["replicas_per_gpu"]
    assert gib["kv"] == pytest.approx(predicted_kv_gib(config, replica_memory(RELOADS, 1)[0]), abs=0.05)
    tokens = logged_kv_tokens(A99K.replica_log(replica))
    assert engine["max_model_len"] < tokens
    assert tokens * A99K.kv_bytes_per_token == pytest.approx(gib["kv"] * 2**30, rel=0.01)


def replica_memory(run: ShapeRun, replica: int) -> tuple[dict, float]:
    """What vLLM logged of a shared-cell replica's GPU memory (GiB) and its share of the GPU, the sum checked."""
    return logged_memory(run.replica_log(replica))
