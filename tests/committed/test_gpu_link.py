"""The committed H200 link run (docs/results/h200-link): the ceiling rule's link record re-read, the
sampler's GPU state summarized again from its rows, and the committed load runs' reloads held against the
link (the load table's link_use), which is what issue 35 asks the pool path to be measured against."""
import json
from pathlib import Path

import pandas as pd
import pytest
from test_gpu_load_runs import C32, SHARED, config_of, rebuilt_table

from kvpool.measure import link
from kvpool.measure.telemetry import gpu_state
from kvpool.report import load

RUN = Path(__file__).resolve().parents[2] / "docs" / "results" / "h200-link"
CEILING = RUN / "results" / "tiers" / "ram" / "ceiling.json"
MIB = 1 << 20


def test_the_link_was_measured_on_the_fleets_gpu_at_each_chunk_s_kv_and_at_1_gib():
    found = json.loads(CEILING.read_text())["link"]
    assert found["applicable"] and found["gpus"] == [0] and found["device_names"] == ["NVIDIA H200"]
    sizes = {(copy["memory"], copy["bytes"]) for copy in found["copies"]}
    # 256, 1,024 and 2,048 tokens of 64 KiB each, and the large copy, from both kinds of host memory
    assert sizes == {(memory, size) for memory in ("pinned", "pageable")
                     for size in (16 * MIB, 64 * MIB, 128 * MIB, link.LARGE_BYTES)}
    assert all(copy["n"] == link.REPEATS and copy["min_gb_per_s"] <= copy["gb_per_s"] <= copy["max_gb_per_s"]
               for copy in found["copies"])
    large = {copy["memory"]: copy["gb_per_s"] for copy in found["copies"] if copy["bytes"] == link.LARGE_BYTES}
    assert found["gb_per_s"] == large["pinned"] == pytest.approx(55.3, abs=0.05)
    # a PCIe Gen5 x16 link from pinned memory; pageable memory reaches an eighth of it at 1 GiB
    assert 50 < large["pinned"] < 64 and large["pageable"] < large["pinned"] / 6


def test_the_sampler_s_gpu_state_reads_again_from_its_rows_and_sees_the_copies():
    copies = json.loads((RUN / "copies.json").read_text())
    power = pd.read_csv(RUN / "copies-power.csv")
    state = gpu_state(power[power["source"].str.startswith("gpu")])
    assert state == copies["summary"]["gpu_state"]
    gpu = state["gpu0"]
    # the counter holds the protocol's bytes too: above the copies' own rate, by less than a tenth
    assert copies["copied_gb_per_s"] < gpu["pcie_rx_gb_per_s"]["mean"] < 1.1 * copies["copied_gb_per_s"]
    assert gpu["pcie_tx_gb_per_s"]["mean"] < gpu["pcie_rx_gb_per_s"]["mean"] / 5
    assert gpu["sm_clock_mhz"]["min"] == gpu["sm_clock_mhz"]["max"] == 1980 and gpu["clock_event_reasons"] == {}


def test_the_shared_pool_at_32_in_flight_uses_about_a_third_of_the_link(tmp_path):
    """The c32 load run and the link were measured in two leases of the same machine kind: the share is
    read across them, as issue 35 did with its own copy test (52.5 GB/s)."""
    rebuilt_table(C32, tmp_path)  # the committed table first, byte for byte
    levels = {(SHARED, level): {"csv": str(C32.level_dir(SHARED, level) / "requests.csv"),
                                "meta": str(C32.level_dir(SHARED, level) / "level.json")}
              for level in C32.levels[SHARED]}
    files = {"csv": str(C32.cell_dir(SHARED) / "reuse.csv"), "meta": str(C32.cell_dir(SHARED) / "reuse.json"),
             "validity": str(C32.cell_dir(SHARED) / "validity.json"),
             "telemetry": str(C32.cell_dir(SHARED) / "telemetry" / "summary.json")}
    out = tmp_path / "with-link"
    out.mkdir()
    load.run_load_table(config_of(C32, SHARED), [SHARED], reuse={SHARED: files}, levels=levels,
                        csv_out=str(out / "load.csv"), md_out=str(out / "load.md"), ceilings=[str(CEILING)])
    table = pd.read_csv(out / "load.csv").set_index("level")
    assert (table["link_ceiling_gb_per_s"] == json.loads(CEILING.read_text())["link"]["gb_per_s"]).all()
    assert table.loc["c32", "link_use"] == pytest.approx(table.loc["c32", "loaded_gb_per_s"] / 55.33, rel=1e-3)
    assert 0.30 < table.loc["c32", "link_use"] < 0.40
    assert table.loc["c1", "link_use"] < table.loc["c16", "link_use"] < table.loc["c32", "link_use"]
    assert "of the link" in (out / "load.md").read_text()


def test_a_ceiling_without_a_link_adds_no_link_column_to_the_load_table(tmp_path):
    """A CPU run's ceiling says the link does not apply: the load table stays as it was (its n/a column
    once widened the page past 1,280 px)."""
    cpu = tmp_path / "tiers" / "ram" / "ceiling.json"
    cpu.parent.mkdir(parents=True)
    cpu.write_text(json.dumps({"gb_per_s": 5.0, "link": link.ceiling([], [], repeats=1)}))
    files = {"csv": str(C32.cell_dir(SHARED) / "reuse.csv"), "meta": str(C32.cell_dir(SHARED) / "reuse.json"),
             "validity": str(C32.cell_dir(SHARED) / "validity.json"),
             "telemetry": str(C32.cell_dir(SHARED) / "telemetry" / "summary.json")}
    load.run_load_table(config_of(C32, SHARED), [SHARED], reuse={SHARED: files}, levels={},
                        csv_out=str(tmp_path / "load.csv"), md_out=str(tmp_path / "load.md"), ceilings=[str(cpu)])
    assert "link_use" not in pd.read_csv(tmp_path / "load.csv")
    assert "of the link" not in (tmp_path / "load.md").read_text()
