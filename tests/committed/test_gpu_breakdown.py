"""The committed H200 breakdown run (docs/results/h200-mp-breakdown): one 64K-token length unit on the MP
server's RAM pool. The breakdown rebuilt from its records equals the committed one, the unit's gate is
judged again to what it recorded, and the run's finding: the reload sits in the queue (an asynchronous
load) at the link's rate, while the rest of the TTFT is around it."""
import json
from pathlib import Path

import pandas as pd
import pytest
from snakemake.utils import validate

from kvpool.report import breakdown
from kvpool.settings import step_settings

RUN = Path(__file__).resolve().parents[2] / "docs" / "results" / "h200-mp-breakdown"
CELL = "backend~lmcache-mp/arm~shared/chunk~256/tier~ram"
UNIT = RUN / "results" / "cells" / CELL / "doc~65536"
LINK_GB_PER_S = json.loads((RUN.parent / "h200-link" / "results" / "tiers" / "ram" / "ceiling.json").read_text())[
    "link"]["gb_per_s"]


def config():
    found = json.loads((UNIT / "manifest.json").read_text())["config"]
    validate(found, str(RUN.parents[2] / "workflow" / "schemas" / "config.schema.yaml"))
    return found


def test_the_breakdown_rebuilds_from_the_unit_s_records_byte_for_byte(tmp_path):
    out = {"csv_out": str(tmp_path / "breakdown.csv"), "md_out": str(tmp_path / "breakdown.md"),
           "figure_dir": str(tmp_path / "figures")}
    breakdown.run_breakdown(step_settings(breakdown.run_breakdown, config()),
                            [{"cell": CELL, "source": "doc~65536"}], [str(UNIT / "requests.csv")], **out)
    for name in ("breakdown.csv", "breakdown.md"):
        assert (tmp_path / name).read_text() == (RUN / "results" / name).read_text()


def test_the_unit_ran_on_an_h200_as_planned_and_its_gate_names_what_failed():
    manifest = json.loads((UNIT / "manifest.json").read_text())
    assert manifest["git"]["commit"] == "b23c7752cf7941e71fe46e24a517dd38d19e3690"
    assert "H200" in json.dumps(manifest["hardware"])
    gate = json.loads((UNIT / "unit.json").read_text())
    assert not gate["valid"]
    failed = [name for name, check in gate["checks"].items() if check.get("ok") is False]
    assert failed == ["output_matches_recompute"] and gate["checks"]["served_as_planned"]["ok"]
    outputs = gate["checks"]["output_matches_recompute"]["value"]
    assert outputs["compared"] == 15 and outputs["exact"] == 3 and outputs["nearest"] == 12


def test_a_64k_reload_waits_in_the_queue_at_the_link_s_rate():
    rows = pd.read_csv(RUN / "results" / "breakdown.csv")
    assert rows["nested"].all() and not rows["separable"].any()  # the MP server retrieves out of the replica
    records = pd.read_csv(UNIT / "requests.csv")
    rates = []
    for _, chain in records.groupby("chain"):
        steps = chain.set_index("step")
        # the next request on the same replica loads nothing from the pool: the queue's difference is the load
        extra_s = steps.loc["cross", "queue_s"] - steps.loc["local-B", "queue_s"]
        rates.append(steps.loc["cross", "external_hit_tokens"] * 64 * 1024 / extra_s / 1e9)
        assert steps.loc["cross", "external_hit_tokens"] == 65792
    assert rates == pytest.approx([57.5, 56.9, 55.5], abs=0.1)
    assert all(0.95 < rate / LINK_GB_PER_S < 1.1 for rate in rates)
    cross = rows[rows["source"] == "doc~65536 cross"]
    # end to end the reload is a third of the link: most of its TTFT is around the transfer
    end_to_end = 65792 * 64 * 1024 / cross["ttft_s"].median() / 1e9
    assert end_to_end < 0.4 * LINK_GB_PER_S
