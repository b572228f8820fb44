"""The second committed H200 load run (docs/results/h200-mp-load-arms): both arms of
config/h200-mp-load.yaml on one machine session, the isolated arm at 1, 4 and 16 in flight and the
shared arm at 1 and 4, its two packed replicas started at once on a fixed KV cache size. Re-read by the
pipeline's own code: each level's gate from its records, the pools repopulated before every level, and
the load table rebuilt byte for byte."""

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml
from snakemake.utils import validate

from kvpool import load, steps
from kvpool.cells import Cell
from kvpool.files import read_json, read_records

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "docs" / "results" / "h200-mp-load-arms"
COMMIT = "ef291c29bbc2796b4dc180fb3b3921a009ba3992"
ISOLATED, SHARED = Cell("lmcache-mp", "isolated", 256, "ram"), Cell("lmcache-mp", "shared", 256, "ram")
LEVELS = {ISOLATED: ["c4", "c16"], SHARED: ["c4"]}
UNITS = [(cell, level) for cell, levels in LEVELS.items() for level in levels]


def cell_dir(cell: Cell) -> Path:
    return RUN / "results" / "cells" / cell.name


@pytest.fixture(scope="module")
def config():
    config = read_json(cell_dir(ISOLATED) / "manifest.json")["config"]
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    return config


def test_both_arms_were_measured_by_one_commit_with_the_packed_replicas_started_at_once(config):
    for cell in LEVELS:
        manifest = read_json(cell_dir(cell) / "manifest.json")
        assert manifest["git"]["commit"] == COMMIT and "H200" in json.dumps(manifest["hardware"])
        replicas = yaml.safe_load((cell_dir(cell) / "plan.yaml").read_text())["replicas"]
        assert [r["gpu"] for r in replicas] == [0, 0] and not any(r["sequential_start"] for r in replicas)
        assert all(r["argv"][r["argv"].index("--kv-cache-memory") + 1] == str(int(44.34 * 2**30)) for r in replicas)
    assert config["engine"]["kv_cache_memory_gib"] == 44.34 and config["engine"]["replicas_per_gpu"] == 2


@pytest.mark.parametrize(("cell", "level"), UNITS, ids=[f"{c.arm}-{lv}" for c, lv in UNITS])
def test_each_level_is_valid_again_from_its_records(config, cell, level):
    unit = cell_dir(cell) / f"load~{level}"
    meta = read_json(unit / "level.json")
    rows = read_records(str(unit / "requests.csv"))
    hits = load.attribution(rows, meta["window_external_tokens"])
    checks = load.level_checks(cell.arm, rows, hits, meta["drop_before_level"], meta["checks"]["pool_restored"],
                               config["workload"]["doc_tokens"], config["min_hit_fraction"],
                               config["max_resident_fraction"])
    assert checks["valid"] and checks["checks"] == meta["checks"]
    assert len(rows) == config["workload"]["documents"] and (rows["prefill_replica"] != rows["serve_replica"]).all()
    # the isolated arm's serving replica never held the document: nothing came from a pool
    expected = 0 if cell.arm == "isolated" else config["workload"]["doc_tokens"]
    assert (rows["cached_tokens"] == expected).all()
    restored = meta["pool_restore"]
    assert restored["bytes"] == restored["cell_bytes"] > 0.9 * config["min_pool_bytes"]


def test_the_load_table_rebuilds_byte_for_byte_and_the_isolated_arm_stops_at_the_gpus_compute(config, tmp_path):
    reuse = {cell: {"csv": str(cell_dir(cell) / "reuse.csv"), "meta": str(cell_dir(cell) / "reuse.json"),
                    "validity": str(cell_dir(cell) / "validity.json"),
                    "telemetry": str(cell_dir(cell) / "telemetry" / "summary.json")} for cell in LEVELS}
    levels = {(cell, level): {"csv": str(cell_dir(cell) / f"load~{level}" / "requests.csv"),
                              "meta": str(cell_dir(cell) / f"load~{level}" / "level.json")} for cell, level in UNITS}
    cells = [SHARED, ISOLATED]
    steps.run_load_table(config, cells, reuse=reuse, levels=levels, csv_out=str(tmp_path / "load.csv"),
                         md_out=str(tmp_path / "load.md"))
    results = RUN / "results"
    assert (tmp_path / "load.csv").read_text() == (results / "load.csv").read_text()
    assert (tmp_path / "load.md").read_text() == (results / "load.md").read_text()
    table = pd.read_csv(results / "load.csv").set_index(["arm", "level"])
    assert table["valid"].all() and (table["errors"] == 0).all()
    isolated, shared = table.loc["isolated"], table.loc["shared"]
    # recomputing 8,192 tokens per follow-up on the shared GPU: throughput flat from c4, TTFT growing with the queue
    assert isolated.loc["c16", "achieved_rps"] < 1.2 * isolated.loc["c4", "achieved_rps"]
    assert isolated.loc[["c1", "c4", "c16"], "ttft_p50_s"].is_monotonic_increasing
    for level in ("c1", "c4"):  # the shared pool: faster and more follow-ups per second at each level
        assert shared.loc[level, "ttft_p50_s"] < isolated.loc[level, "ttft_p50_s"]
        assert shared.loc[level, "achieved_rps"] > isolated.loc[level, "achieved_rps"]
