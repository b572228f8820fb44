"""The committed backend comparisons of issue 49 (docs/results/h200-backends and its second sitting,
h200-backends-rerun: two replicas packed on one lent GPU, the 7.1B random Llama, 20 documents of 12,000 tokens, a
multiple of no block or chunk size): vLLM's own tiered offloading (vllm-fs) on /dev/shm and on the disk, LMCache's
MP server (RAM) and LMCache's in-process fs:// pool, re-read by the pipeline's own code: each gate again from its
records, each reload's source from vLLM's counters, the plans' connectors, and the first sitting's two failures
with the causes the records name."""

from pathlib import Path

import pandas as pd
import pytest

from kvpool.cells import Cell
from kvpool.engine.plan_types import read_plan
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records
from kvpool.studies import study_a

RUN = Path(__file__).resolve().parents[2] / "docs" / "results" / "h200-backends"
PLANNED, MEASURED = "ed18f187968a073700a6ccc9510286ecf162853d", "9577a49a00214e7ec57c2ca914199aa463808149"
WHOLE = 12000 // 256 * 256  # 11,776 tokens: the documents' whole chunks
VALID = [Cell("vllm-fs", "shared", 256, "ram"), Cell("vllm-fs", "shared", 256, "disk"),
         Cell("lmcache-mp", "shared", 256, "ram"), Cell("lmcache-mp", "isolated", 256, "ram")]
INVALID = {Cell("vllm-fs", "isolated", 256, "ram"): {"zero_errors"},
           Cell("lmcache-fs", "shared", 256, "ram"): {"preflight", "output_matches_recompute"}}


def folder(cell: Cell, run: Path = RUN) -> Path:
    return run / "results" / "cells" / cell.name


def gate_again(cell: Cell, tmp_path: Path, run: Path = RUN) -> dict:
    """The cell's gate again from its records in ``run``, equal to the one committed."""
    cell_dir = folder(cell, run)
    config = read_json(cell_dir / "manifest.json")["config"]
    study_a.run_validity(config, cell, populate_csv=cell_dir / "populate.csv", populate_json=cell_dir / "populate.json",
                         reuse_csv=cell_dir / "reuse.csv", reuse_json=cell_dir / "reuse.json",
                         reference_csv=run / "results" / "reference" / "outputs.csv",
                         populate_digests=cell_dir / "populate-digests.csv",
                         reuse_digests=cell_dir / "pool-digests.csv", out=tmp_path / "validity.json")
    again, committed = read_json(tmp_path / "validity.json"), read_json(cell_dir / "validity.json")
    assert again == committed
    return again


@pytest.mark.parametrize("cell", VALID + list(INVALID), ids=lambda cell: cell.name)
def test_every_cell_ran_vllm_0_26_on_one_gpu_in_one_sitting(cell):
    manifest = read_json(folder(cell) / "manifest.json")
    # a cell's manifest is its plan's: the vllm-fs RAM cells were planned one call before the launch check's fix
    assert manifest["git"]["commit"] in (PLANNED, MEASURED) and not manifest["git"]["dirty"]
    assert manifest["versions"]["vllm"] == "0.26.0" and manifest["versions"]["lmcache"] == "0.5.3"
    assert manifest["hardware"]["gpu"]["devices"] == ["NVIDIA H100 80GB HBM3"]
    workload = manifest["config"]["workload"]
    assert (workload["documents"], workload["doc_tokens"]) == (20, 12000) and 12000 % 256


@pytest.mark.parametrize("cell", VALID, ids=lambda cell: cell.name)
def test_the_valid_cells_pass_every_check_again_with_twenty_reloads(cell, tmp_path):
    gate = gate_again(cell, tmp_path)
    assert gate["valid"]
    outputs = gate["checks"]["output_matches_recompute"]["value"]
    assert outputs["compared"] == outputs["equal"] == outputs["exact"] == 20
    rows = read_records(str(folder(cell) / "reuse.csv"))
    loaded = WHOLE if cell.arm == "shared" else 0
    assert len(rows) == 20 and (rows["prefill_replica"] != rows["serve_replica"]).all()
    assert (rows["external_hit_tokens"] == loaded).all() and (rows["local_cache_hit_tokens"] == 0).all()


def test_vllm_fs_on_the_disk_read_every_reload_from_the_drive():
    cell = Cell("vllm-fs", "shared", 256, "disk")
    drop = read_json(folder(cell) / "drop.json")
    assert drop["resident_fraction"] == 0.0 and drop["filesystems"] == ["ext4"]
    reuse = read_json(folder(cell) / "telemetry" / "summary.json")["reuse"]["drive"]
    # 20 reloads of 11,776 tokens at 64 KiB a token: 15.4 GB, and the drive read that much in the window
    assert reuse["read_bytes"] >= 20 * WHOLE * 65536
    gate = read_json(folder(cell) / "validity.json")
    assert gate["checks"]["cold_reads"]["status"] == "passed"


@pytest.mark.parametrize("arm", ["shared", "isolated"])
def test_vllm_fs_plans_give_the_fs_tier_the_pool_folder_and_one_hash_seed(arm):
    plan = read_plan(folder(Cell("vllm-fs", arm, 256, "ram")) / "plan.yaml")
    extras = [replica.kv_transfer["kv_connector_extra_config"] for replica in plan.replicas]
    roots = [extra["secondary_tiers"][0]["root_dir"] for extra in extras]
    assert roots == [replica.pool_dir for replica in plan.replicas]
    assert len(set(roots)) == (1 if arm == "shared" else 2)
    assert {extra["spec_name"] for extra in extras} == {"TieringOffloadingSpec"}
    assert {replica.env["PYTHONHASHSEED"] for replica in plan.replicas} == {"0"}


def test_populate_waited_for_vllms_asynchronous_stores():
    """Every document's 46 whole chunks were files before the drop (the preflight's probe had its 2 at the answer)."""
    for tier in ("ram", "disk"):
        populate = read_json(folder(Cell("vllm-fs", "shared", 256, tier)) / "populate.json")
        settled = populate["stores_settled"]
        assert settled["settled"] and settled["min_files"] == 20 * 46 and settled["files"] >= 20 * 46
        assert populate["preflight"]["probe_store"] == {**populate["preflight"]["probe_store"], "chunks": 2,
                                                       "landed": 2}


@pytest.mark.parametrize("cell", INVALID, ids=lambda cell: cell.name)
def test_the_invalid_cells_fail_on_what_the_records_say(cell, tmp_path):
    gate = gate_again(cell, tmp_path)
    assert not gate["valid"]
    assert {name for name, check in gate["checks"].items() if check["ok"] is False} == INVALID[cell]


def test_lmcache_fs_returned_other_kv_than_was_stored_on_every_reload(tmp_path):
    gate = gate_again(Cell("lmcache-fs", "shared", 256, "ram"), tmp_path)
    assert gate["checks"]["preflight"]["value"] == {"hit_tokens": 512, "outputs_match": False}
    assert gate["checks"]["output_matches_recompute"]["value"]["equal"] == 0
    rows = read_records(str(folder(Cell("lmcache-fs", "shared", 256, "ram")) / "reuse.csv"))
    assert (rows["external_hit_tokens"] == WHOLE).all()  # every reload hit: the damage is in the bytes


def test_the_isolated_vllm_fs_cell_lost_a_replica_whose_engine_core_was_killed():
    """Replica 1's engine core died at once (no trace) while three 16 GiB offload regions of stopped replicas
    still filled /dev/shm; kvpool now removes them with their replica (kvpool.engine.processes.OFFLOAD_REGION)."""
    rows = read_records(str(folder(Cell("vllm-fs", "isolated", 256, "ram")) / "reuse.csv"))
    failed = rows[rows["error"].fillna("") != ""]
    assert len(failed) == 4 and set(failed["serve_replica"]) == {1}
    log = (RUN / "logs" / "cell" / Cell("vllm-fs", "isolated", 256, "ram").name / "replicas" / "replica-1.log")
    assert "engine core exited unexpectedly" in log.read_text()


def test_the_table_puts_the_backends_side_by_side():
    table = pd.read_csv(RUN / "results" / "cell_table.csv").set_index("cell")
    p50 = table["ttft_p50_s"]
    fs_ram, mp = p50[VALID[0].name], p50[VALID[2].name]
    # LMCache's MP server reloads from RAM faster than vLLM's fs tier on /dev/shm, and their intervals are apart
    assert mp < fs_ram and table.loc[VALID[2].name, "ttft_p50_ci_high_s"] < table.loc[VALID[0].name,
                                                                                        "ttft_p50_ci_low_s"]
    # from the disk the fs tier is slower than recomputing the document (the MP isolated cell, same machine)
    assert p50[VALID[1].name] > p50[VALID[3].name]


# The second sitting (docs/results/h200-backends-rerun): after the offload-region fix, both backends' RAM cells
# and vllm-fs's disk cells, both arms, on one machine within 14 minutes, all at one commit.
RERUN = RUN.parent / "h200-backends-rerun"
RERUN_COMMIT = "2384354983acc7d32e567adfa1345f0cd13d6b30"
RERUN_CELLS = [Cell(backend, arm, 256, tier) for backend, tier in
               [("vllm-fs", "ram"), ("vllm-fs", "disk"), ("lmcache-mp", "ram")] for arm in ("shared", "isolated")]


def test_the_second_sitting_ran_every_cell_on_one_machine_at_one_commit():
    manifests = [read_json(folder(cell, RERUN) / "manifest.json") for cell in RERUN_CELLS]
    assert {(m["git"]["commit"], m["git"]["dirty"]) for m in manifests} == {(RERUN_COMMIT, False)}
    assert len({str(m["hardware"]) for m in manifests}) == 1
    assert manifests[0]["hardware"]["gpu"]["devices"] == ["NVIDIA H100 80GB HBM3"]
    started = sorted(pd.Timestamp(m["created_at"]) for m in manifests)
    assert started[-1] - started[0] < pd.Timedelta(minutes=15)
    assert (RERUN / "results" / "reference" / "outputs.csv").read_bytes() == \
        (RUN / "results" / "reference" / "outputs.csv").read_bytes()  # one workload, one split-matched reference


@pytest.mark.parametrize("cell", RERUN_CELLS, ids=lambda cell: cell.name)
def test_every_cell_of_the_second_sitting_is_valid_again_with_twenty_reloads(cell, tmp_path):
    gate = gate_again(cell, tmp_path, RERUN)
    assert gate["valid"]
    outputs = gate["checks"]["output_matches_recompute"]["value"]
    assert outputs["compared"] == outputs["equal"] == outputs["exact"] == 20
    rows = read_records(str(folder(cell, RERUN) / "reuse.csv"))
    assert len(rows) == 20 and (rows["prefill_replica"] != rows["serve_replica"]).all() and not rows["error"].any()
    assert (rows["external_hit_tokens"] == (WHOLE if cell.arm == "shared" else 0)).all()


def test_the_isolated_vllm_fs_pools_hold_the_same_bytes_as_the_shared_one():
    kv = pd.read_csv(RERUN / "results" / "kv_bytes.csv")
    across = kv[kv["comparison"] == "store_across_arms"]
    assert len(across) == 2 and (across["keys"] == 920).all() and (across["equal"] == across["keys"]).all()


def test_the_second_sitting_orders_the_backends_as_the_first():
    table = pd.read_csv(RERUN / "results" / "cell_table.csv").set_index("cell")
    fs_ram, fs_disk, mp = (Cell(backend, "shared", 256, tier).name for backend, tier in
                           [("vllm-fs", "ram"), ("vllm-fs", "disk"), ("lmcache-mp", "ram")])
    assert table.loc[mp, "ttft_p50_ci_high_s"] < table.loc[fs_ram, "ttft_p50_ci_low_s"]
    recompute = Cell("vllm-fs", "isolated", 256, "disk").name
    assert table.loc[fs_disk, "ttft_p50_ci_low_s"] > table.loc[recompute, "ttft_p50_ci_high_s"]
