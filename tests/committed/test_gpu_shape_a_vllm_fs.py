"""The committed GPU run of vLLM's own offloading on Study A's model shape (issue 52).
docs/results/h100-shape-a-vllm-fs: config/h100-shape-a-vllm-fs.yaml, the Qwen3-30B-A3B shape (weights drawn by vLLM,
FP8 online) on two replicas packed on one H100, six 40,960-token documents, vllm-fs (each replica's CPU tier and an
fs tier of files in /dev/shm), both arms."""

from pathlib import Path

import pandas as pd
import pytest
from snakemake.utils import validate
from support import REPO
from support.committed import assert_same_gate

from kvpool.cells import Cell
from kvpool.engine import shapes
from kvpool.measure import model_check
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records
from kvpool.studies import study_a

RUN = REPO / "docs" / "results" / "h100-shape-a-vllm-fs"
COMMIT = "84758299c16f3af96d193b87b6604330a05f0b06"
CELLS = [Cell("vllm-fs", arm, 256, "ram") for arm in ("shared", "isolated")]


def cell_dir(cell: Cell) -> Path:
    return RUN / "results" / "cells" / cell.name


def run_config() -> dict:
    config = read_json(cell_dir(CELLS[0]) / "manifest.json")["config"]
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    return config


@pytest.mark.parametrize("cell", CELLS, ids=lambda cell: cell.arm)
def test_each_cell_ran_the_shipped_config_at_one_clean_commit_on_the_h100_with_vllm_0_26(cell):
    manifest = read_json(cell_dir(cell) / "manifest.json")
    assert manifest["git"] == {"commit": COMMIT, "dirty": False, "source": "KVPOOL_GIT_COMMIT"}
    assert manifest["hardware"]["gpu"]["devices"] == ["NVIDIA H100 80GB HBM3"]
    assert (manifest["versions"]["vllm"], manifest["versions"]["lmcache"]) == ("0.26.0", "0.5.3")
    config = manifest["config"]
    assert config["backends"] == ["vllm-fs"] and config["tiers"] == {"ram": "/dev/shm/kvpool"}
    assert (config["random_model"]["architecture"], config["engine"]["quantization"]) == ("qwen3-moe", "fp8")
    assert config["workload"]["documents"] == 6 and config["workload"]["doc_tokens"] == 40960


def test_the_model_check_probed_at_the_documents_length_and_found_the_replicas_alike():
    recorded = read_json(RUN / "results" / "model-check.json")
    assert recorded["head_tokens"] == model_check.head_tokens(run_config()) == 40960
    again = model_check.verdict(recorded["answers"], [], recorded["head_tokens"])
    assert again["ok"] and again["identical"] and again["distinct_answers"] == 3
    assert {key: recorded[key] for key in again} == again


@pytest.mark.parametrize("cell", CELLS, ids=lambda cell: cell.arm)
def test_each_cell_is_valid_again_from_its_records(cell, tmp_path):
    folder = cell_dir(cell)
    study_a.run_validity(run_config(), cell, populate_csv=folder / "populate.csv",
                         populate_json=folder / "populate.json", reuse_csv=folder / "reuse.csv",
                         reuse_json=folder / "reuse.json",
                         reference_csv=RUN / "results" / "reference" / "outputs.csv",
                         populate_digests=folder / "populate-digests.csv",
                         reuse_digests=folder / "pool-digests.csv", out=tmp_path / "validity.json")
    again, recorded = read_json(tmp_path / "validity.json"), read_json(folder / "validity.json")
    assert_same_gate(recorded["checks"], again["checks"])
    assert again["valid"] and recorded["valid"]
    outputs = again["checks"]["output_matches_recompute"]["value"]
    assert outputs["exact"] == outputs["equal"] == 6
    # populate's chunk files, read back unchanged after reuse
    unchanged = again["checks"]["pool_unchanged"]["value"]
    assert unchanged["files"] >= 6 * 40960 // 256 and unchanged["changed"] == unchanged["missing"] == 0


def test_the_pool_files_hold_every_documents_kv_at_the_shapes_96_kib_a_token():
    config = run_config()
    per_token = shapes.kv_bytes_per_token(config["random_model"], config["engine"]["dtype"])
    assert per_token == 96 * 1024
    documents = config["workload"]["documents"] * config["workload"]["doc_tokens"] * per_token
    for cell in CELLS:
        pool = read_json(cell_dir(cell) / "populate.json")["pool"]
        assert pool["resident_fraction"] == 1.0 and documents <= pool["bytes"] <= 1.01 * documents


def test_the_shared_arm_reloaded_every_document_and_the_isolated_arm_recomputed_it():
    doc_tokens = run_config()["workload"]["doc_tokens"]
    shared, isolated = (read_records(cell_dir(cell) / "reuse.csv") for cell in CELLS)
    assert (shared["prefill_replica"] != shared["serve_replica"]).all()
    assert (shared["external_hit_tokens"] == doc_tokens).all() and (shared["local_compute_tokens"] == 256).all()
    assert (isolated["external_hit_tokens"] == 0).all() and (isolated["local_compute_tokens"] >= doc_tokens).all()
    assert (shared["local_cache_hit_tokens"] == 0).all() and (isolated["local_cache_hit_tokens"] == 0).all()
    table = pd.read_csv(RUN / "results" / "cell_table.csv").set_index("arm")
    for arm, records in (("shared", shared), ("isolated", isolated)):
        assert table.loc[arm, "ttft_p50_s"] == pytest.approx(records["ttft_s"].median(), rel=1e-12)
        assert table.loc[arm, "ttft_n"] == len(records) == 6
    assert table.loc["isolated", "ttft_p50_ci_low_s"] > 4 * table.loc["shared", "ttft_p50_ci_high_s"]


def test_vllm_fs_reloaded_slower_than_the_mp_servers_ram_on_the_same_shape_and_documents():
    """Beside docs/results/h100-shape-a (the MP server's L1, the same shape and 40,960-token documents, an H100 of
    the device tool a day earlier): the intervals of the shared arms' p50s are apart; the isolated arms' overlap."""
    mp = pd.read_csv(REPO / "docs" / "results" / "h100-shape-a" / "results" / "cell_table.csv").set_index("arm")
    fs = pd.read_csv(RUN / "results" / "cell_table.csv").set_index("arm")
    assert fs.loc["shared", "ttft_p50_ci_low_s"] > mp.loc["shared", "ttft_p50_ci_high_s"]
    assert fs.loc["isolated", "ttft_p50_ci_low_s"] < mp.loc["isolated", "ttft_p50_ci_high_s"]
    assert mp.loc["isolated", "ttft_p50_ci_low_s"] < fs.loc["isolated", "ttft_p50_ci_high_s"]
