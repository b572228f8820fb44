"""The committed H200 run of a shared lmcache-mp pool with a server per replica over one L2 folder
(config/h200-mp-servers.yaml), re-read: the plan gave each replica its own server on the one folder, and
every follow-up loaded its whole document through its own server from files the other server wrote, read
from the drive; the one-server cell beside it, made in a later session, and both cells' answers against
the recompute (docs/results/h200-mp-servers/README.md)."""

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
ONE = RUN / "results" / "cells" / Cell("lmcache-mp", "shared", 256, "disk").name


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


def test_one_server_beside_it_loaded_every_document_from_the_drive_too():
    plan = yaml.safe_load((ONE / "plan.yaml").read_text())
    assert len(plan["servers"]) == 1 and {r["server"] for r in plan["replicas"]} == {0}
    reuse = read_records(str(ONE / "reuse.csv"))
    assert len(reuse) == 4 and (reuse["prefill_replica"] != reuse["serve_replica"]).all()
    assert (reuse["external_hit_tokens"] == 16384).all()
    meta = read_json(ONE / "reuse.json")
    assert meta["drop_before_reuse"]["resident_fraction"] == 0.0
    assert meta["pool_server"]["0"]["metrics"]["lmcache_mp_l2_prefetch_hit_chunks_total"] == 4 * 16384 / 256
    assert read_json(ONE / "manifest.json")["git"]["commit"].startswith("0e36d2d")


def test_both_cells_answers_equal_the_recompute_and_their_ttfts_are_not_told_apart():
    """The reference made in the second session checks both cells' four answers (equal, in the split
    measured); with n = 4 the two TTFT p50 intervals overlap, so the table shows no difference between one
    server and two, and says nothing smaller."""
    for folder in (FOLDER, ONE):
        gate = read_json(folder / "validity.json")
        assert gate["valid"] and all(check["status"] == "passed" for check in gate["checks"].values())
        assert gate["checks"]["output_matches_recompute"]["value"]["exact"] == 4
    rows = pd.read_csv(RUN / "results" / "cell_table.csv").set_index("backend")
    per_replica, one = rows.loc["lmcache-mp+servers=per-replica"], rows.loc["lmcache-mp"]
    assert per_replica["ttft_p50_ci_low_s"] < one["ttft_p50_ci_high_s"]
    assert one["ttft_p50_ci_low_s"] < per_replica["ttft_p50_ci_high_s"]
