"""measured_only on records brought back from another machine: the session's study run copied, without
its model, prompts or pools, must summarize to the run's own tables and measure nothing."""

import subprocess
import sys

import pandas as pd
from support import CONFIGS, REPO
from support.e2e import CELL


def summarize_measured(tree):
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "all", "-s", str(REPO / "Snakefile"),
                           "--directory", str(tree), "--configfile", str(CONFIGS / "e2e.yaml"),
                           "--config", "measured_only=True"], capture_output=True, text=True, timeout=600)


def test_measured_only_summarizes_a_brought_back_tree_as_the_run_did(study_run, tmp_path):
    # A results tree brought back from another machine: the records, without the model, the prompts
    # or the pools. measured_only must give the run's own tables and measure nothing.
    tree = tmp_path / "tree"
    (tree / "results").mkdir(parents=True)
    for part in ("cells", "reference", "tiers", "studyb"):
        subprocess.run(["cp", "-r", str(study_run / "results" / part), str(tree / "results")], check=True)
    (tree / "results" / "studyb" / "validity.json").unlink()  # Study B's blocks, not its tables
    result = summarize_measured(tree)
    assert result.returncode == 0, result.stderr[-3000:]
    for table in ("table1.csv", "validity.csv", "kv_bytes.csv", "tier_compare.csv", "locality.csv", "sessions.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(tree / "results" / table), pd.read_csv(study_run / "results" / table),
                                      obj=table)
    assert (tree / "results" / "report.html").stat().st_size > 10_000
    assert not (tree / "resources").exists() and not (tree / "logs" / "cell").exists()


def test_measured_only_summarizes_the_cells_a_cut_short_run_finished(study_run, tmp_path):
    # the isolated cell never finished its reuse and no tier ceiling was read
    tree = tmp_path / "tree"
    (tree / "results").mkdir(parents=True)
    for part in ("cells", "reference"):
        subprocess.run(["cp", "-r", str(study_run / "results" / part), str(tree / "results")], check=True)
    isolated = tree / CELL.format(backend="lmcache-fs", arm="isolated")
    (isolated / "reuse.json").unlink()
    result = summarize_measured(tree)
    assert result.returncode == 0, result.stderr[-3000:]
    validity = pd.read_csv(tree / "results" / "validity.csv")
    assert list(validity["cell"]) == ["backend~lmcache-fs/arm~shared/chunk~256/tier~disk"] and validity["valid"].all()
    table = pd.read_csv(tree / "results" / "table1.csv").set_index("metric")
    ours = pd.read_csv(study_run / "results" / "table1.csv").set_index("metric")
    assert table.loc["ttft_p50_s", "shared"] == ours.loc["ttft_p50_s", "shared"]
    assert table["isolated"].isna().all()
    # no ceiling, no Table 2; no isolated pool to compare bytes with
    assert not (tree / "results" / "tier_compare.csv").exists()
    assert pd.read_csv(tree / "results" / "kv_bytes.csv").empty
    assert (tree / "results" / "report.html").stat().st_size > 10_000


def test_measured_only_with_another_config_than_the_runs_is_refused_before_it_judges(study_run, tmp_path):
    """The run's cells judged again under a config that reads other gate settings would overwrite their
    verdicts: refused while the workflow is parsed, naming each cell and the keys, and nothing is written."""
    tree = tmp_path / "tree"
    (tree / "results").mkdir(parents=True)
    subprocess.run(["cp", "-r", str(study_run / "results" / "cells"), str(tree / "results")], check=True)
    verdicts = sorted((tree / "results" / "cells").rglob("validity.json"))
    before = [path.read_text() for path in verdicts]
    result = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "all", "-s", str(REPO / "Snakefile"),
                             "--directory", str(tree), "--configfile", str(CONFIGS / "e2e.yaml"),
                             "--config", "measured_only=True", "min_hit_fraction=0.99"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert "min_hit_fraction (this config: min_hit_fraction 0.99" in result.stderr
    assert CELL.format(backend="lmcache-fs", arm="shared").split("results/cells/")[-1] in result.stderr
    assert [path.read_text() for path in verdicts] == before
