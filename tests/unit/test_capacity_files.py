"""Capacity of a pool of files (lmcache-fs): the pool folder sized by a filesystem of the capacity's size
(kvpool.engine.sized_pool), and the unit's view of it (pool_views.FilePool): what each document's populate
left, whether the pool holds a document whole, and the silent miss that follows from it."""

import errno
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from kvpool.config import pool_bytes_per_cell, problems
from kvpool.engine import pool_views, sized_pool
from kvpool.engine.model import engine_pool_bytes_per_token
from kvpool.measure import unit
from kvpool.studies import capacity


@pytest.fixture
def files_config(config, tmp_path):
    """The embedded default on a shared lmcache-fs cell on a drive tier, with capacity fractions."""
    def made(fractions, tiers=None):
        made_config = {**config, "backends": ["lmcache-fs"], "arms": ["shared"],
                       "tiers": tiers or {"disk": str(tmp_path / "pools" / "disk")}}
        made_config["capacity"] = {**config["capacity"], "fractions": fractions}
        return made_config

    return made


def test_a_shared_pool_of_files_takes_capacity_units_with_no_eviction_policy(files_config):
    made = files_config([0.25, 1.0])
    assert [(cell.backend, cell.tier, fraction) for cell, fraction in capacity.units(made)] == [
        ("lmcache-fs", "disk", 0.25), ("lmcache-fs", "disk", 1.0)]
    cell = capacity.units(made)[0][0]
    assert capacity.eviction_policy(made, cell) == capacity.FILE_POLICY
    # the plan's config is unchanged: the limit is the filesystem, mounted by the unit
    assert capacity.limited_config(made, cell, 10**6) is made
    assert capacity.problems(made, check_host=False) == []


def test_mounting_needs_root_and_the_tools_and_says_which_is_missing(files_config, monkeypatch):
    made = files_config([0.5])
    monkeypatch.setattr(sized_pool.os, "geteuid", lambda: 1000)
    (refused,) = capacity.problems(made)
    assert "needs root" in refused and "uid 1000" in refused and "lmcache-redis or lmcache-mp" in refused
    monkeypatch.setattr(sized_pool.os, "geteuid", lambda: 0)
    monkeypatch.setattr(sized_pool.shutil, "which", lambda tool: None if tool == "mkfs.ext4" else f"/sbin/{tool}")
    (refused,) = capacity.problems(made)
    assert "needs mkfs.ext4 on PATH" in refused
    # a memory tier's pool is a tmpfs: no mkfs needed
    assert capacity.problems(made, check_host=False) == []


def test_a_drive_tier_without_room_for_the_largest_capacitys_image_is_refused_with_the_numbers(
        files_config, free_disk, tmp_path, monkeypatch):
    """The unit's ext4 image takes the tier's space beside the cell's own pool: config's one tier check counts
    it, at the largest capacity, and names it."""
    made = {**files_config([0.25, 1.0]), "keep_pools": False, "drive_ceiling_bytes": 1 << 20}
    monkeypatch.setattr(sized_pool.os, "geteuid", lambda: 0)
    (cell,) = capacity.cells(made)
    image = sized_pool.image_bytes(capacity.capacity_bytes(made, cell.chunk, 1.0, engine_pool_bytes_per_token(made)))
    assert capacity.drive_tier_images(made, "disk") == [image]
    needed = pool_bytes_per_cell(made, "shared") + image + (1 << 20)
    free_disk(needed + 10**6)
    assert problems(made, tmp_path) == []
    free_disk(needed - 10**6)
    (refused,) = problems(made, tmp_path)
    assert refused.startswith("tiers.disk:") and f"needs {needed / 1e9:.2f} GB" in refused
    assert "the largest pool and a capacity unit's image" in refused
    # a memory tier's pool of files is a tmpfs of host RAM: nothing on the tier
    assert capacity.drive_tier_images(files_config([1.0], {"ram": "/dev/shm/kvpool-test"}), "ram") == []


def test_the_drive_tiers_filler_leaves_at_most_the_capacity_free_in_whole_blocks():
    block = sized_pool.BLOCK
    assert sized_pool.filler_bytes(10 * block, 4 * block) == 6 * block
    assert sized_pool.filler_bytes(10 * block, 4 * block + 1) == 6 * block  # rounded up: never more than the limit
    assert sized_pool.filler_bytes(3 * block, 4 * block) == 0
    limit = 123_456_789
    assert sized_pool.image_bytes(limit) % block == 0 and sized_pool.image_bytes(limit) > limit * 1.05


def chunk_file(folder: Path, name: str, size: int = 1000) -> None:
    (folder / f"{name}.data").write_bytes(b"\0" * size)


def test_a_file_pool_knows_each_documents_files_and_whether_it_holds_the_document_whole(tmp_path):
    pool = pool_views.FilePool(tmp_path, {"kind": "tmpfs"}, doc_chunks=2)
    for name in ("a0", "a1"):
        chunk_file(tmp_path, name)
    pool.stored(0)
    chunk_file(tmp_path, "b0")  # document 1's second chunk did not fit
    pool.stored(1)
    pool.stored(2)  # nothing landed
    assert pool.files_of == {0: {"a0.data", "a1.data"}, 1: {"b0.data"}, 2: set()}
    assert [pool.holds(doc) for doc in (0, 1, 2, 3)] == [True, False, False, False]
    (tmp_path / "a1.data").unlink()
    assert not pool.holds(0)
    state = pool.state()
    assert state["kv_bytes"] == 2000 and state["chunks"] == 2 and state["evicted_keys"] == 0
    assert pool.peak_kv_bytes == 3000 and pool.evicted() == 0


def test_a_file_pool_settles_once_its_temp_files_are_renamed(tmp_path):
    pool = pool_views.FilePool(tmp_path, {}, doc_chunks=1)
    (tmp_path / "c0.tmp").write_bytes(b"\0" * 10)

    def land():
        time.sleep(0.5)
        (tmp_path / "c0.tmp").rename(tmp_path / "c0.data")

    writer = threading.Thread(target=land)
    writer.start()
    started = time.monotonic()
    pool.stored(0)
    writer.join()
    assert time.monotonic() - started >= 0.5 and pool.files_of[0] == {"c0.data"}


def test_a_recompute_of_a_document_the_file_pool_held_whole_is_a_silent_miss():
    def row(doc_id, external, held):
        return {"doc_id": doc_id, "external_hit_tokens": external, "local_cache_hit_tokens": 0, "error": None,
                "evicted_before": 0, "held_before": held}

    rows = capacity.account([row(0, 0, True), row(1, 0, False), row(2, 1024, True), row(3, 512, False)],
                            1024, 0.9, {0: 0, 1: 0, 2: 0, 3: 0})
    assert [(r["source"], r["silent_miss"]) for r in rows] == [
        ("recomputed", True), ("recomputed", False), ("pool", False), ("partial", False)]
    # a server's pool has no held_before: nothing evicted since the store is what makes a miss silent
    server = capacity.account([{**row(1, 0, None), "evicted_before": 0}], 1024, 0.9, {1: 0})
    assert server[0]["silent_miss"] is True


def can_mount() -> str | None:
    found = sized_pool.problems({"disk": Path("/tmp")})
    return found[0] if found else None


@pytest.mark.skipif(can_mount() is not None, reason=f"cannot mount here: {can_mount()}")
@pytest.mark.parametrize("tier", ["drive", "memory"])
def test_a_sized_folder_holds_at_most_its_capacity_and_is_gone_afterwards(tmp_path, tier):
    root = tmp_path if tier == "drive" else Path("/dev/shm") / f"kvpool-test-{os.getpid()}-{tmp_path.name}"
    folder = root / "shared"
    folder.mkdir(parents=True)
    limit = 20_000_000
    try:
        with sized_pool.sized_folder(folder, limit) as mounted:
            assert mounted["kind"] == ("ext4 on a loop device" if tier == "drive" else "tmpfs")
            assert limit - 2 * sized_pool.BLOCK <= mounted["free_bytes"] <= limit
            assert os.path.ismount(folder)
            with pytest.raises(OSError) as full, open(folder / "big", "wb") as f:
                f.write(b"\0" * (limit + 10**6))
                f.flush()
                os.fsync(f.fileno())
            assert full.value.errno == errno.ENOSPC
        assert not os.path.ismount(folder) and os.listdir(folder) == []
        assert list(root.glob(".*.ext4")) == []
        attached = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=False).stdout
        assert str(root) not in attached
    finally:
        if tier == "memory":
            shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif(can_mount() is not None, reason=f"cannot mount here: {can_mount()}")
def test_a_sized_folder_an_earlier_unit_left_mounted_is_released_before_the_pool_is_emptied(tmp_path):
    folder = tmp_path / "unit" / "shared"
    folder.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1048576", "kvpool-capacity", str(folder)], check=True)
    try:
        assert sized_pool.release_stale(tmp_path / "unit") == [str(folder)]
    finally:
        if os.path.ismount(folder):
            subprocess.run(["umount", str(folder)], check=False)
    assert not os.path.ismount(folder) and sized_pool.release_stale(tmp_path / "unit") == []


@pytest.mark.parametrize("sized", [True, False])
def test_a_store_the_sized_pool_refuses_is_its_capacity_not_an_error(sized, monkeypatch, tmp_path, caplog):
    """A phase's failed pool writes are recorded either way; a full tier is an error, a capacity unit's
    sized folder refusing a store is its limit at work."""
    import logging

    import pandas as pd

    class Sampler:
        meta = {}

        def frames(self):
            return pd.DataFrame(), pd.DataFrame()

    monkeypatch.setattr(unit, "tier_disks", lambda plan: ([], []))
    monkeypatch.setattr(unit.logs, "new_lines_matching", lambda folder, start: ["[Errno 28] No space left on device"])
    meta = {"stores_refused_by": capacity.FILE_REFUSALS} if sized else {}
    paths = unit.UnitPaths(str(tmp_path / "requests.csv"), str(tmp_path / "unit.json"), str(tmp_path / "drive.csv"),
                           str(tmp_path / "power.csv"), str(tmp_path))
    with caplog.at_level(logging.INFO, logger=unit.log.name):
        measured = unit.run_unit({}, lambda disks: unit.UnitResult(pd.DataFrame(), meta, Sampler()), paths, "capacity")
    found = measured.meta
    assert found["pool_write_errors"] == ["[Errno 28] No space left on device"]
    levels = {record.levelname for record in caplog.records if "No space left" in record.getMessage()}
    assert levels == ({"INFO"} if sized else {"ERROR"})
