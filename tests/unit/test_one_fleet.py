"""A cell runs populate, drop and reuse on one fleet (kvpool.studies.study_a.run_cell), except where its reuse
needs a fresh server: which cells do, what the one fleet leaves to each phase, and the waits and refusals
around it, with no replica started."""

import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from kvpool.cells import Cell
from kvpool.engine import prompts
from kvpool.engine.plan import fleet_plan
from kvpool.engine.plan_types import write_plan
from kvpool.measure import kvbytes
from kvpool.measure.timed import settled_stores
from kvpool.studies import study_a

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("backend", "tier", "one"), [
    ("lmcache-fs", "disk", True), ("lmcache-fs", "ram", True), ("lmcache-local-disk", "disk", True),
    ("lmcache-redis", "ram", True), ("lmcache-mp", "ram", True), ("lmcache-mp", "disk", False),
])
def test_every_cell_runs_on_one_fleet_but_an_mp_pool_on_a_drive(config, backend, tier, one):
    """An MP server keeps what reuse would read in its L1: on a drive tier its reuse needs a fresh server,
    so fresh replicas (they register with it); a memory tier's pool is the L1 itself."""
    config["lmcache_mp"]["memory_tiers"] = ["ram"]
    assert study_a.one_fleet(config, Cell(backend, "shared", 256, tier)) is one


def test_run_cell_refuses_a_cell_that_needs_a_fresh_server(config, tmp_path):
    config["lmcache_mp"]["memory_tiers"] = ["ram"]
    with pytest.raises(ValueError, match="needs a fresh server and fleet"):
        study_a.run_cell(config, Cell("lmcache-mp", "shared", 256, "disk"), "plan.yaml", "prompts.jsonl", {}, "",
                         {}, {})


def test_settled_stores_waits_for_a_store_that_lands_after_the_answer(tmp_path):
    """LMCache puts a request's chunks after its answer: the wait ends once the files stop changing, with
    the late file counted, and a temp file still there keeps it waiting."""
    pool = tmp_path / "pool"
    pool.mkdir()
    (pool / "a.data").write_bytes(b"x" * 10)
    (pool / "b.tmp").write_bytes(b"y" * 5)

    def late_store():
        time.sleep(0.6)
        (pool / "b.tmp").rename(pool / "b.data")

    threading.Thread(target=late_store).start()
    found = settled_stores([pool], None, poll_s=0.2, timeout_s=10)
    assert found["settled"] and found["files"] == 2 and found["bytes"] == 15 and found["waited_s"] >= 0.6


def test_settled_stores_gives_up_at_its_timeout_and_says_so(tmp_path):
    pool = tmp_path / "pool"
    pool.mkdir()
    (pool / "c.tmp").write_bytes(b"z")  # never renamed: a store that does not finish
    found = settled_stores([pool], None, poll_s=0.1, timeout_s=0.5)
    assert not found["settled"] and found["files"] == 1


class Server:
    pool_bytes_metric = "pool_bytes"

    def __init__(self, values):
        self.values = iter(values)

    def metrics(self):
        return {"pool_bytes": next(self.values)}


def test_settled_stores_waits_for_a_server_s_pool_to_stop_growing(tmp_path):
    found = settled_stores([], [Server([10, 20, 30, 30, 30])], poll_s=0.05, timeout_s=5)
    assert found["settled"] and found["server_pool_bytes"] == [30]


class DeadServer(Server):
    def metrics(self):
        raise OSError("redis server 0: Connection refused")


def test_settled_stores_does_not_wait_on_a_server_that_died(tmp_path):
    """A pool server killed mid-phase is named by its phase's record; the wait reads it as gone, not as an
    error that would lose the phase's measured rows."""
    found = settled_stores([], [DeadServer([])], poll_s=0.05, timeout_s=5)
    assert found["settled"] and found["server_pool_bytes"] == [None]


def test_a_reuse_of_its_own_refuses_a_pool_warmed_by_an_earlier_reuse(config, tmp_path):
    """Where reuse is a job of its own (an MP cell on a drive), a pool holding more files than populate hashed
    was warmed by an earlier reuse: refused before any replica starts, naming the command that measures the
    cell from its populate."""
    cell = Cell("lmcache-fs", "shared", 256, "disk")
    config["tiers"] = {"disk": str(tmp_path / "tier")}
    root = study_a.pool_root(config, cell)
    shared = root / "shared"
    shared.mkdir(parents=True)
    for name in ("one.data", "two.data", "three.data"):
        (shared / name).write_bytes(b"kv")
    plan = fleet_plan(config, cell, "m", tmp_path, [18100, 18101], "config")
    assert {replica.pool_dir for replica in plan.replicas} == {str(shared)}
    write_plan(plan, tmp_path / "plan.yaml")
    workload = prompts.make_workload(list(range(100)), 2, 16, 4, 0)
    prompts.write_workload(tmp_path / "prompts.jsonl", workload)
    pd.DataFrame({"doc_id": [0, 1], "prefill_replica": [0, 1]}).to_csv(tmp_path / "populate.csv", index=False)
    pd.DataFrame([{"copy": "shared", "key": name, "bytes": 2, "blake2b": "00", "stored_in": "populate"}
                  for name in ("one.data", "two.data")], columns=kvbytes.DIGEST_COLUMNS).to_csv(
        tmp_path / "populate-digests.csv", index=False)
    out = {name: str(tmp_path / name) for name in ("reuse.csv", "reuse.json", "drive.csv", "power.csv", "d.csv")}
    with pytest.raises(RuntimeError, match="1 more than populate left") as refused:
        study_a.run_reuse(config, cell, plan_path=str(tmp_path / "plan.yaml"),
                          prompts_path=str(tmp_path / "prompts.jsonl"),
                          populate_csv=str(tmp_path / "populate.csv"),
                          populate_digests=str(tmp_path / "populate-digests.csv"), csv_out=out["reuse.csv"],
                          json_out=out["reuse.json"], drive_csv=out["drive.csv"], power_csv=out["power.csv"],
                          digests_csv=out["d.csv"], log_dir=str(tmp_path / "logs"))
    assert "--forcerun populate" in str(refused.value)
    assert not Path(out["reuse.csv"]).exists()
