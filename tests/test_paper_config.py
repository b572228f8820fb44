"""The study's published matrix plans on any machine (no GPU, no drives, no model needed)."""

import re
import subprocess
import sys

from conftest import REPO


def test_paper_config_dry_run_plans_the_whole_matrix(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
         "--configfile", str(REPO / "config" / "paper.yaml")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    # 2 backends x 2 arms x 3 chunk sizes x 2 tiers = 24 cells; no model is built for a named model
    assert re.search(r"^populate\s+24$", out, re.M), out[-2000:]
    assert re.search(r"^reuse\s+24$", out, re.M)
    assert not re.search(r"^model\s+\d+$", out, re.M)
    assert "backend~lmcache-fs/arm~shared/chunk~2048/tier~qlc/plan.yaml" in out


def test_tier_compare_target_builds_only_what_it_needs(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "results/tier_compare.csv", "-s", str(REPO / "Snakefile"),
         "--directory", str(tmp_path), "--configfile", str(REPO / "tests" / "configs" / "e2e.yaml")],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for rule in ("populate", "reuse", "telemetry", "ceiling", "tier_compare"):
        assert re.search(rf"^{rule}\s+\d+$", out, re.M), rule
    assert re.search(r"^populate\s+1$", out, re.M)  # the shared arm only
    for rule in ("reference", "validity", "table1", "report"):
        assert not re.search(rf"^{rule}\s+\d+$", out, re.M), rule
