"""Issue 51, item 1: a pool outside kvpool's folder must never pass. LMCache reads a pool's folder out of a
URL (lmcache-fs's remote_url fs://, lmcache-local-disk's local_disk file://), so a tier path with a '#'
put the pool at the path's head, shared by every cell and run; a second run's populate then loaded its
documents from the first run's pool and the cell still passed (memory tier, min_pool_bytes 0). Such
paths are refused while parsing and when planning, and the gate checks that populate loaded nothing
and that what it stored is in the cell's own pool, whatever the config says."""

import json
import shutil

import pandas as pd
import pytest
from support import REPO
from support.records import DOC, STORED_CHUNKS, frames

from kvpool.cells import Backend, Cell
from kvpool.config import problems
from kvpool.engine import pool_url
from kvpool.engine.plan import fleet_plan
from kvpool.measure.files import read_json
from kvpool.measure.validity import evaluate, failures
from kvpool.studies import study_a

FS, DISK = Backend.FS, Backend.LOCAL_DISK
KEY = {FS: pool_url.REMOTE_URL, DISK: pool_url.LOCAL_DISK}  # the setting each names its pool's folder in
COMMITTED = REPO / "docs" / "results" / "h200-mp"
DISK_CELL = Cell("lmcache-mp", "shared", 256, "disk")


@pytest.mark.parametrize("backend, character, read_as", [
    (FS, "#", ["/pools/a"]), (FS, "?", ["/pools/a"]),            # a fragment, a query: the rest is cut off
    (FS, ",", ["/pools/a", "b/cell/"]), (DISK, ",", ["/pools/a", "b/cell/"]),  # several base paths
    (FS, "\t", ["/pools/ab/cell/"]), (FS, "\n", ["/pools/ab/cell/"]), (FS, "\r", ["/pools/ab/cell/"]),
])
def test_a_folder_lmcache_reads_as_another_is_found(backend, character, read_as):
    assert pool_url.misread(KEY[backend], f"/pools/a{character}b/cell") == read_as


@pytest.mark.parametrize("backend", [FS, DISK])
@pytest.mark.parametrize("folder", ["/pools/a b/cell", "/pools/100%/cell", "/pools/é/cell",
                                    "/pools/backend~lmcache-mp+servers=per-replica"])
def test_a_folder_lmcache_reads_whole_passes(backend, folder):
    assert pool_url.misread(KEY[backend], folder) is None


def test_local_disk_keeps_what_a_url_would_cut():
    assert pool_url.misread(KEY[DISK], "/pools/a#b?c") is None  # local_disk is split at commas, not parsed as a URL


@pytest.mark.parametrize("backend, path, key", [(FS, "/dev/shm/kvprobe3#x", "remote_url"),
                                                (FS, "pools?x", "remote_url"),
                                                (DISK, "/dev/shm/a,b", "local_disk")])
def test_a_tier_path_lmcache_would_cut_is_refused_naming_the_key_and_the_value(config, tmp_path, backend, path, key):
    config.update(backends=[backend], tiers={"ram": path})
    found = [p for p in problems(config, tmp_path, check_paths=False) if "LMCache" in p]
    assert len(found) == 1 and "\n" not in found[0]
    assert found[0].startswith(f"tiers.ram: {path!r} does not survive LMCache's {key} setting")


def test_the_issue_path_names_the_folder_the_pool_would_really_be_in(config, tmp_path):
    config.update(backends=[FS], tiers={"ram": "/dev/shm/kvprobe3#x"})
    found = [p for p in problems(config, tmp_path, check_paths=False) if p.startswith("tiers.ram")]
    assert "would keep its pool in '/dev/shm/kvprobe3'," in found[0]


def test_a_tier_only_server_backends_use_may_hold_a_hash(config, tmp_path):
    """An MP server's L2 folder and a Redis server's --dir are arguments of their own, taken verbatim."""
    config.update(backends=["lmcache-redis"], tiers={"ram": "/dev/shm/a#b"})
    config["lmcache_redis"]["tiers"] = ["ram"]
    assert not [p for p in problems(config, tmp_path, check_paths=False) if "LMCache" in p and "tiers.ram" in p]


def test_a_working_directory_lmcache_would_cut_is_refused_naming_it(config, tmp_path):
    workdir = tmp_path / "run#2"
    workdir.mkdir()
    config.update(backends=[FS], tiers={"ram": "/dev/shm/kvpool"})
    found = [p for p in problems(config, workdir, check_paths=False) if "LMCache" in p]
    assert len(found) == 1 and found[0].startswith(f"the working directory {str(workdir)!r} puts tiers.ram's pools")


@pytest.mark.parametrize("backend", [FS, DISK])
def test_the_plan_refuses_a_pool_folder_lmcache_would_read_as_another(config, backend):
    config["tiers"] = {"disk": "/data/pools,b"}
    with pytest.raises(ValueError, match=r"LMCache reads the pool folder '/data/pools,b/kvpool-pools/"):
        fleet_plan(config, Cell(backend, "shared", 256, "disk"), "/models/m", "/tmp/cell", [18100, 18101], "config",
                   available_cores=[0, 1])


def test_the_plan_refuses_a_working_directory_no_config_names(config, tmp_path, monkeypatch):
    """The pool folder holds the working directory's name: a '#' there moves the pool too."""
    workdir = tmp_path / "run#2"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    config["tiers"] = {"disk": "pools"}
    with pytest.raises(ValueError, match=r"LMCache reads the pool folder '.*/run#2/pools/kvpool-pools/.*' out of "
                                         r"remote_url 'fs://localhost:0.*' as '.*/run'"):
        fleet_plan(config, Cell(FS, "shared", 256, "disk"), "/models/m", "/tmp/cell", [18100, 18101], "config",
                   available_cores=[0, 1])


def issue_gate(config, populate_hits=(0, 1023, 0, 0), own_pool=None):
    """The issue's cell: lmcache-fs on a memory tier, min_pool_bytes 0, a pool LMCache kept outside the cell's
    folder (which held nothing after populate), and one document populate loaded from the first run's pool."""
    config["workload"].update(documents=4, doc_tokens=DOC)
    config["min_pool_bytes"] = 0
    populate, reuse, reference = frames(populate_hits=populate_hits)
    return evaluate("shared", config, populate, reuse, reference, {"memory_backed": True, "resident_fraction": 0.0},
                    0, {"ok": True, "hit_tokens": 512, "expect_shared": True},
                    pool_unchanged={"files": 0, "changed": 0, "missing": 0, "example": ""},
                    own_pool=own_pool or {"files": 0, "bytes": 0, "resident_bytes": 0, "chunks": 0})


def test_a_foreign_warm_pool_is_not_valid(config):
    result = issue_gate(config)
    assert not result["valid"]
    loaded = result["checks"]["populate_loaded_nothing"]
    assert loaded["status"] == "failed" and loaded["value"] == 1023
    assert loaded["examples"] == ["document 1 loaded 1023 tokens from a pool during populate"]
    own = result["checks"]["populate_stored_in_own_pool"]
    assert own["status"] == "failed" and own["value"] == 0 and own["threshold"] == STORED_CHUNKS - 2
    assert {reason.split(":")[0] for reason in failures(result)} == {"populate_loaded_nothing",
                                                                     "populate_stored_in_own_pool"}


def test_each_half_of_the_check_fails_the_cell_alone(config):
    cold_but_elsewhere = issue_gate(config, populate_hits=(0,) * 4)
    assert not cold_but_elsewhere["valid"]
    assert cold_but_elsewhere["checks"]["populate_loaded_nothing"]["status"] == "passed"
    warm_but_own = issue_gate(config, own_pool={"files": STORED_CHUNKS, "bytes": 10**9, "chunks": STORED_CHUNKS})
    assert not warm_but_own["valid"]
    assert warm_but_own["checks"]["populate_stored_in_own_pool"]["status"] == "passed"


def test_records_from_before_the_counts_make_the_checks_not_applicable_not_passed(config):
    result = issue_gate(config, populate_hits=(None,) * 4, own_pool={"bytes": 0})
    for name in ("populate_loaded_nothing", "populate_stored_in_own_pool"):
        assert result["checks"][name]["status"] == "not_applicable" and result["checks"][name]["ok"] is None
        assert "recorded before" in result["checks"][name]["reason"]


def committed_cell_copy(tmp_path):
    """A committed cell of a pool of files (h200-mp's disk tier, 1,282 files after populate) in ``tmp_path``."""
    source = COMMITTED / "results" / "cells" / DISK_CELL.name
    tmp_path.mkdir()
    for name in ("populate.csv", "populate.json", "reuse.csv", "reuse.json", "populate-digests.csv",
                 "pool-digests.csv", "manifest.json"):
        shutil.copy(source / name, tmp_path / name)
    return tmp_path


def gate_of(cell_dir, tmp_path):
    study_a.run_validity(read_json(cell_dir / "manifest.json")["config"], DISK_CELL,
                         populate_csv=cell_dir / "populate.csv", populate_json=cell_dir / "populate.json",
                         reuse_csv=cell_dir / "reuse.csv", reuse_json=cell_dir / "reuse.json",
                         reference_csv=COMMITTED / "results" / "reference" / "outputs.csv",
                         populate_digests=cell_dir / "populate-digests.csv",
                         reuse_digests=cell_dir / "pool-digests.csv", out=tmp_path / "validity.json")
    return read_json(tmp_path / "validity.json")


def test_the_gate_counts_populate_s_stores_in_the_cell_s_own_pool_folder(tmp_path):
    cell_dir = committed_cell_copy(tmp_path / "cell")
    assert gate_of(cell_dir, tmp_path)["checks"]["populate_stored_in_own_pool"]["value"] == 1282
    # the same run, had LMCache kept its pool elsewhere: the cell's folder holds nothing after populate
    digests = pd.read_csv(cell_dir / "populate-digests.csv")
    digests.head(0).to_csv(cell_dir / "populate-digests.csv", index=False)
    meta = read_json(cell_dir / "populate.json")
    meta["pool"].update(files=0, bytes=0, resident_bytes=0)
    (cell_dir / "populate.json").write_text(json.dumps(meta))
    again = gate_of(cell_dir, tmp_path)
    assert not again["valid"]
    own = again["checks"]["populate_stored_in_own_pool"]
    assert (own["status"], own["value"], own["threshold"]) == ("failed", 0, 5 * 65536 // 256)  # documents' chunks


def test_the_gate_reads_what_populate_loaded_from_its_records(tmp_path):
    cell_dir = committed_cell_copy(tmp_path / "cell")
    populate = pd.read_csv(cell_dir / "populate.csv")
    populate.loc[populate["doc_id"] == 2, "external_hit_tokens"] = 65280
    populate.to_csv(cell_dir / "populate.csv", index=False)
    again = gate_of(cell_dir, tmp_path)
    assert not again["valid"]
    assert again["checks"]["populate_loaded_nothing"]["examples"] == [
        "document 2 loaded 65280 tokens from a pool during populate"]
