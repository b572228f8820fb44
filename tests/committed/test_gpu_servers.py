"""The committed H200 run of a shared lmcache-mp pool with a server per replica over one L2 folder
(config/h200-mp-servers.yaml), re-read: the plan gave each replica its own server on the one folder, and
every follow-up loaded its whole document through its own server from files the other server wrote, read
from the drive (docs/results/h200-mp-servers/README.md)."""

import json
from pathlib import Path

import pandas as pd
import yaml

from kvpool.cells import Cell
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records

RUN = Path(__file__).resolve().parents[2] / "docs" / "results" / "h200-mp-servers"
CELL = Cell("lmcache-mp", "shared", 256, "disk", servers="per-replica")
FOLDER = RUN / "results" / "cells" / CELL.name


def test_each_replica_had_a_server_of_its_own_on_the_one_shared_folder():
    plan = yaml.safe_load((FOLDER / "plan.yaml").read_text())
    servers = plan["servers"]
    assert len(servers) == 2 and len({s["port"] for s in servers}) == 2
    assert len({s["l2_dir"] for s in servers}) == 1 and servers[0]["l2_dir"].endswith("/shared")
    for server in servers:
        adapter = json.loads(server["argv"][server["argv"].index("--l2-adapter") + 1])
        assert adapter["base_path"] == server["l2_dir"]
    ports = {s["index"]: s["port"] for s in servers}
    assert [r["kv_transfer"]["kv_connector_extra_config"]["lmcache.mp.port"] for r in plan["replicas"]] == [
        ports[r["server"]] for r in plan["replicas"]] and [r["server"] for r in plan["replicas"]] == [0, 1]


def test_every_follow_up_loaded_its_document_from_the_other_servers_files_read_from_the_drive():
    reuse = read_records(str(FOLDER / "reuse.csv"))
    assert len(reuse) == 4 and (reuse["prefill_replica"] != reuse["serve_replica"]).all()
    assert (reuse["external_hit_tokens"] == 16384).all() and (reuse["error"].fillna("") == "").all()
    meta = read_json(FOLDER / "reuse.json")
    assert meta["drop_before_reuse"]["resident_fraction"] == 0.0
    for counters in meta["pool_server"].values():
        metrics = counters["metrics"]
        assert metrics["lmcache_mp_l2_prefetch_hit_chunks_total"] == 2 * 16384 / 256
        assert metrics["lmcache_mp_num_chunks_loaded_total"] == 2 * 16384 / 256
    # the disk read at least the documents' KV during the reuse window: 4 x 64 chunks of 16 MiB
    drive = pd.read_csv(FOLDER / "telemetry" / "reuse-drive.csv").query("device == 'vda'")
    read = drive["rd_sectors"].iloc[-1] - drive["rd_sectors"].iloc[0]
    assert read * 512 >= 4 * 64 * 2**24


def test_the_gate_re_read_without_a_reference_leaves_the_answers_not_verified():
    """The run never made the recompute reference: measured_only still judges the cell on what it has, every
    other check passed, and names the answers not verified rather than passed."""
    assert not (RUN / "results" / "reference").exists()
    gate = read_json(FOLDER / "validity.json")
    outputs = gate["checks"].pop("output_matches_recompute")
    assert outputs["status"] == "not_verified" and "no recompute reference" in outputs["reason"]
    assert gate["valid"] and all(check["status"] == "passed" for check in gate["checks"].values())
    table = pd.read_csv(RUN / "results" / "validity.csv")
    assert table["not_verified"].tolist() == ["output_matches_recompute"] and table["valid"].all()
