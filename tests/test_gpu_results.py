"""The committed H200 run of the lmcache-mp backend (docs/results/h200-mp), re-read by the pipeline's
own code: each cell's gate again from its records, the server's counters, the drive's reads and the
KV bytes of the disk tier's pool files."""

import json
from pathlib import Path

import pytest
import yaml
from snakemake.utils import validate

from kvpool import kvbytes, report, steps
from kvpool.cells import Cell, cells
from kvpool.files import read_json, read_records

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "docs" / "results" / "h200-mp"
CELLS = [Cell("lmcache-mp", arm, 256, tier) for tier in ("ram", "disk") for arm in ("shared", "isolated")]
SHARED_RAM, _, SHARED_DISK, _ = CELLS
DOCUMENTS, DOC_TOKENS, KV_BYTES_PER_TOKEN = 5, 65536, 64 * 1024


def folder(cell: Cell) -> Path:
    return RUN / "results" / "cells" / cell.name


def run_config():
    config = read_json(folder(SHARED_RAM) / "manifest.json")["config"]
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    return config


def test_every_cell_of_the_run_was_measured_by_one_commit_and_config():
    manifests = [read_json(folder(cell) / "manifest.json") for cell in CELLS]
    assert {m["git"]["commit"] for m in manifests} == {"ca5df2e37828eb01bfe4fb27e7ed8ac4b0807fb4"}
    assert all(m["config"] == manifests[0]["config"] for m in manifests)
    assert set(cells(run_config())) == set(CELLS)


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.name)
def test_each_cell_is_valid_again_from_its_records(cell, tmp_path):
    cell_dir = folder(cell)
    steps.run_validity(run_config(), cell, populate_csv=cell_dir / "populate.csv",
                       populate_json=cell_dir / "populate.json", reuse_csv=cell_dir / "reuse.csv",
                       reuse_json=cell_dir / "reuse.json", reference_csv=RUN / "results" / "reference" / "outputs.csv",
                       populate_digests=cell_dir / "populate-digests.csv", reuse_digests=cell_dir / "pool-digests.csv",
                       out=tmp_path / "validity.json")
    again, recorded = read_json(tmp_path / "validity.json"), read_json(cell_dir / "validity.json")
    assert {name: (c["ok"], c["value"]) for name, c in again["checks"].items()} == \
           {name: (c["ok"], c["value"]) for name, c in recorded["checks"].items()}
    assert again["valid"] and again["checks"]["output_matches_recompute"]["value"] == DOCUMENTS


@pytest.mark.parametrize("cell", [SHARED_RAM, SHARED_DISK], ids=lambda c: c.name)
def test_the_server_counted_every_reloaded_chunk(cell):
    table = report.pool_server_table(RUN, [cell])
    reuse = table[table["phase"] == "reuse"].iloc[0]
    followups = read_records(folder(cell) / "reuse.csv")
    # the server's lookups and the replicas' /metrics agree: every document token came from the pool
    assert reuse["lookup_hit_tokens_total"] == followups["external_hit_tokens"].sum() == DOCUMENTS * DOC_TOKENS
    assert reuse["num_chunks_loaded_total"] == DOCUMENTS * DOC_TOKENS / 256


def test_the_disk_tier_reloaded_from_the_drive_not_from_memory():
    # a fresh server (empty L1) found every chunk in its L2 folder and the drive read the whole pool
    server = report.pool_server_table(RUN, [SHARED_DISK]).query("phase == 'reuse'").iloc[0]
    assert server["l2_prefetch_hit_chunks_total"] == DOCUMENTS * DOC_TOKENS / 256
    drive = read_json(folder(SHARED_DISK) / "telemetry" / "summary.json")["reuse"]["drive"]
    assert drive["read_bytes"] >= DOCUMENTS * DOC_TOKENS * KV_BYTES_PER_TOKEN


def test_the_disk_tiers_pool_files_agree_bit_for_bit_across_the_arms():
    digests = {(c.backend, c.chunk, c.tier, c.arm): kvbytes.read_digests(folder(c) / "pool-digests.csv")
               for c in CELLS if c.tier == "disk"}
    table = kvbytes.kv_bytes_table(digests, run_config()).set_index("comparison")
    assert table.loc["store_across_arms", "equal"] == table.loc["store_across_arms", "keys"] == DOCUMENTS * 256
    assert kvbytes.unexpected(table.reset_index()).empty


def test_the_plan_ran_one_server_on_loopback_with_an_l1_for_the_whole_pool():
    plan = yaml.safe_load((folder(SHARED_RAM) / "plan.yaml").read_text())
    (server,) = plan["servers"]
    assert server["host"] == "127.0.0.1" and server["l2_dir"] is None and server["l1_size_gib"] == 28.7
    assert {json.loads(r["argv"][r["argv"].index("--kv-transfer-config") + 1])["kv_connector"]
            for r in plan["replicas"]} == {"LMCacheMPConnector"}
    disk = yaml.safe_load((folder(SHARED_DISK) / "plan.yaml").read_text())
    (server,) = disk["servers"]
    adapter = json.loads(server["argv"][server["argv"].index("--l2-adapter") + 1])
    assert adapter == {"type": "fs", "base_path": server["l2_dir"], "use_odirect": False}
