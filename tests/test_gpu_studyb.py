"""The committed H200 run of Study B's design (docs/results/h200-mp-studyb: both replicas packed on one
H200, LMCache's MP server as the ON pool), re-read by the pipeline's own code: the tables and the
verdict again from the blocks' records, what every ON block loaded, and where ON and OFF disagree."""

from pathlib import Path

import pandas as pd
import pytest
from snakemake.utils import validate

from kvpool import steps
from kvpool.files import read_json, read_records

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "docs" / "results" / "h200-mp-studyb"
BLOCKS = RUN / "results" / "studyb" / "backend~lmcache-mp" / "chunk~256" / "tier~ram"
NAMES = ["1-off", "2-on", "3-on", "4-off"]
COMMIT = "f15fc09980291c1310c4400e4f6247622050e05d"


@pytest.fixture(scope="module")
def rows() -> pd.DataFrame:
    return pd.concat([read_records(BLOCKS / f"block~{name}" / "requests.csv") for name in NAMES], ignore_index=True)


def test_every_block_ran_one_commit_and_config_on_the_gpu():
    manifests = [read_json(BLOCKS / f"block~{name}" / "manifest.json") for name in NAMES]
    assert {m["git"]["commit"] for m in manifests} == {COMMIT}
    assert {m["versions"]["vllm"] for m in manifests} == {"0.26.0"}
    configs = [m["config"] for m in manifests]
    assert all(config == configs[0] for config in configs)
    validate(configs[0], str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    assert configs[0]["study_b"]["contexts"] == [8192, 32768, 65536, 131072]


def test_the_tables_and_the_verdict_come_again_from_the_records(tmp_path):
    config = read_json(BLOCKS / "block~1-off" / "manifest.json")["config"]
    blocks = {name: {"csv": str(BLOCKS / f"block~{name}" / "requests.csv"),
                     "meta": str(BLOCKS / f"block~{name}" / "block.json")} for name in NAMES}
    out = {name: str(tmp_path / name) for name in ("locality.csv", "sessions.csv", "summary.csv", "validity.json",
                                                   "studyb.md")}
    steps.run_studyb_tables(config, blocks, locality_csv=out["locality.csv"], sessions_csv=out["sessions.csv"],
                            summary_csv=out["summary.csv"], validity_out=out["validity.json"], md_out=out["studyb.md"],
                            figures_dir=str(tmp_path / "studyb" / "figures"))
    assert read_json(out["validity.json"]) == read_json(RUN / "results" / "studyb" / "validity.json")
    assert Path(out["studyb.md"]).read_text() == (RUN / "results" / "studyb.md").read_text()


def test_each_on_cross_step_loaded_the_whole_document_and_beat_off(rows):
    """The cross-replica step: the whole context from the pool in ON, none in OFF; ON at least 9x
    faster from 32K (9.3x there, 26x at 128K), as the page says."""
    cross = rows[(rows["kind"] == "chain") & (rows["step"] == "cross")]
    on, off = cross[cross["arm"] == "on"], cross[cross["arm"] == "off"]
    assert (on["external_hit_tokens"] == on["context"]).all() and (off["external_hit_tokens"] == 0).all()
    ratio = off.groupby("context")["ttft_s"].median() / on.groupby("context")["ttft_s"].median()
    assert ratio[32768] > 9 and ratio[131072] > 20 and ratio.is_monotonic_increasing


def test_on_and_off_disagree_only_where_on_reused_kv_the_other_replica_computed(rows):
    """Each path is deterministic (both ON blocks give the same answers, both OFF blocks too); the
    answers differ only in alternating sessions, at turns whose ON prompt reused chunks the other
    replica computed in the turn before (a different prefill split than OFF's recompute)."""
    answers = rows.pivot_table(index="payload_sha256", columns="block", values="output_text", aggfunc="first")
    both = answers.dropna()
    assert (both["2-on"] == both["3-on"]).all() and (both["1-off"] == both["4-off"]).all()
    differ = both.index[both["2-on"] != both["1-off"]]
    assert len(differ) == 2  # one turn in each alternating session; a later turn then no longer pairs
    flipped = rows[rows["payload_sha256"].isin(differ) & (rows["arm"] == "on")]
    assert set(flipped["placement"]) == {"alternating"} and (flipped["turn"] >= 2).all()
    assert (flipped["external_hit_tokens"] > 0).all() and (flipped["local_hit_tokens"] > 0).all()
    chains = rows[rows["kind"] == "chain"]
    assert not chains["payload_sha256"].isin(differ).any()  # whole documents reloaded: identical answers


def test_measured_only_all_on_a_study_b_run_builds_its_page_alone(tmp_path):
    """A working directory with Study B's blocks and no Study A cell: `all` builds Study B's page and
    verdict, not Study A's tables from no cells."""
    import shutil
    import subprocess
    import sys

    work = tmp_path / "run"
    shutil.copytree(RUN, work)
    (work / "results" / "studyb.md").unlink()
    out = subprocess.run([sys.executable, "-m", "snakemake", "all", "--cores", "1", "-s", str(REPO / "Snakefile"),
                          "--directory", str(work), "--configfile", str(REPO / "config" / "h200-mp-studyb.yaml"),
                          "--config", "measured_only=True"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (work / "results" / "studyb.md").read_text() == (RUN / "results" / "studyb.md").read_text()
    assert not (work / "results" / "table1.csv").exists()
