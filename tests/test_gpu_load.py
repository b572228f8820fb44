"""The committed H200 load run (docs/results/h200-mp-load: two replicas packed on one H200, LMCache's
MP server with a host-RAM L1, 64 documents of 8,192 tokens, the shared arm at 1, 4 and 16 follow-ups
in flight), re-read by the pipeline's own code: each level's gate again from its records, the pool
repopulated to the cell's bytes before every level, the server's counters against the responses' hits,
and the load table rebuilt byte for byte."""

import json
from pathlib import Path

import pandas as pd
import pytest
from snakemake.utils import validate

from kvpool import load, steps
from kvpool.cells import Cell
from kvpool.files import read_json, read_records

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "docs" / "results" / "h200-mp-load"
CELL = Cell("lmcache-mp", "shared", 256, "ram")
CELL_DIR = RUN / "results" / "cells" / CELL.name
COMMIT = "c02e6dc67c44e9ab0e032066f77c4b6db7937009"
LEVELS = ["c4", "c16"]
KV_BYTES_PER_TOKEN = 64 * 1024  # the random Llama's 32 layers x 4 KV heads x 128 x (K, V) x 2 bytes


@pytest.fixture(scope="module")
def config():
    config = read_json(CELL_DIR / "manifest.json")["config"]
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    return config


def level_dir(level: str) -> Path:
    return CELL_DIR / f"load~{level}"


def test_the_cell_and_its_levels_were_measured_by_one_commit_on_the_h200(config):
    manifest = read_json(CELL_DIR / "manifest.json")
    assert manifest["git"]["commit"] == COMMIT
    assert "H200" in json.dumps(manifest["hardware"])
    assert config["load"]["concurrency"] == [1, 4, 16, 32] and config["engine"]["replicas_per_gpu"] == 2
    for level in LEVELS:  # every level ran after the cell's reuse, on the same day's machine
        meta = read_json(level_dir(level) / "level.json")
        assert meta["level"] == level and meta["started_at"] > read_json(CELL_DIR / "reuse.json")["started_at"]


@pytest.mark.parametrize("level", LEVELS)
def test_each_level_is_valid_again_from_its_records(config, level):
    meta = read_json(level_dir(level) / "level.json")
    rows = read_records(str(level_dir(level) / "requests.csv"))
    hits = load.attribution(rows, meta["window_external_tokens"])
    checks = load.level_checks(CELL.arm, rows, hits, meta["drop_before_level"], meta["checks"]["pool_restored"],
                               config["workload"]["doc_tokens"], config["min_hit_fraction"],
                               config["max_resident_fraction"])
    assert checks["valid"] and checks["checks"] == meta["checks"]
    # N in flight: the level sent every document's follow-up once, to the replica that did not prefill it
    assert len(rows) == config["workload"]["documents"] and set(rows["doc_id"]) == set(range(len(rows)))
    assert (rows["prefill_replica"] != rows["serve_replica"]).all()


@pytest.mark.parametrize("level", LEVELS)
def test_every_level_started_on_a_pool_populated_again_to_the_cells_bytes(config, level):
    """A memory pool cannot be restored in place: each level's fresh server was populated again, by
    the same placement, to exactly the L1 bytes of the cell's own populate."""
    restored = read_json(level_dir(level) / "level.json")["pool_restore"]
    documents, tokens = config["workload"]["documents"], config["workload"]["doc_tokens"]
    # the documents' KV and the preflight probe's whole chunks (it stores 513 tokens: two chunks)
    probe = read_json(level_dir(level) / "populate.json")["preflight"]["probe_tokens"] // CELL.chunk * CELL.chunk
    assert restored["bytes"] == restored["cell_bytes"] == (documents * tokens + probe) * KV_BYTES_PER_TOKEN
    again = pd.read_csv(level_dir(level) / "populate.csv")
    cell = pd.read_csv(CELL_DIR / "populate.csv")
    assert again["prefill_replica"].tolist() == cell["prefill_replica"].tolist()


@pytest.mark.parametrize("level", LEVELS)
def test_the_server_loaded_every_chunk_the_responses_counted(config, level):
    meta = read_json(level_dir(level) / "level.json")
    rows = read_records(str(level_dir(level) / "requests.csv"))
    counters = meta["pool_server"]["0"]["metrics"]
    tokens = config["workload"]["doc_tokens"]
    assert (rows["external_hit_tokens"] == tokens).all() and (rows["cached_tokens"] == tokens).all()
    assert counters["lmcache_mp_lookup_hit_tokens_total"] == rows["external_hit_tokens"].sum()
    assert counters["lmcache_mp_num_chunks_loaded_total"] == len(rows) * tokens // CELL.chunk


def test_the_load_table_rebuilds_byte_for_byte_and_shows_the_reload_rate_climbing(config, tmp_path):
    results = RUN / "results"
    files = {"csv": str(CELL_DIR / "reuse.csv"), "meta": str(CELL_DIR / "reuse.json"),
             "validity": str(CELL_DIR / "validity.json"), "telemetry": str(CELL_DIR / "telemetry" / "summary.json")}
    levels = {(CELL, level): {"csv": str(level_dir(level) / "requests.csv"),
                              "meta": str(level_dir(level) / "level.json")} for level in LEVELS}
    steps.run_load_table(config, [CELL], reuse={CELL: files}, levels=levels, csv_out=str(tmp_path / "load.csv"),
                         md_out=str(tmp_path / "load.md"))
    assert (tmp_path / "load.csv").read_text() == (results / "load.csv").read_text()
    assert (tmp_path / "load.md").read_text() == (results / "load.md").read_text()
    table = pd.read_csv(results / "load.csv").set_index("level")
    # the measured finding: from 1 to 16 in flight the pool's KV delivered per second keeps climbing
    # (no plateau of the software path yet) while TTFT p50 grows, every follow-up a whole-document hit
    assert table.loc[["c1", "c4", "c16"], "loaded_gb_per_s"].is_monotonic_increasing
    assert table.loc[["c1", "c4", "c16"], "ttft_p50_s"].is_monotonic_increasing
    assert (table["hit_fraction"] == 1.0).all() and (table["errors"] == 0).all() and table["valid"].all()
