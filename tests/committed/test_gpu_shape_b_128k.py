"""The committed GPU run of Study B's hybrid shape at Study B's 128K, cut short by the session's device time after
three of its four blocks (issue 52), re-read by the pipeline's own code. docs/results/h100-shape-b-128k:
config/h100-shape-b-128k.yaml, two packed replicas of the random hybrid 27B on one H100, a 131,200-token chain. The
blocks that finished are checked as the pipeline checks them; the study's tables wait for the fourth block, which
the next machine runs from this folder (bench/device_resume.sh)."""

from pathlib import Path

import pandas as pd
import pytest
from support import REPO, shipped
from support.committed import assert_same_gate, logged_kv_tokens, logged_memory, predicted_kv_gib

from kvpool.config import validated
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records
from kvpool.studies import studyb

RUN = REPO / "docs" / "results" / "h100-shape-b-128k"
SHORTER = REPO / "docs" / "results" / "h100-shape-b"  # the same launch at 32,000 tokens, which sized this one
COMMIT = "b17872286ebe9b11e3f2cdaed2a2004e7c2f3be0"
CELL = Path("studyb") / "backend~lmcache-mp" / "chunk~1600" / "tier~ram"
FINISHED = ["1-off", "2-on", "3-on"]
CONTEXT = 131200


def block(name: str) -> Path:
    return RUN / "results" / CELL / f"block~{name}"


def run_config() -> dict:
    return read_json(block("1-off") / "manifest.json")["config"]


def replica_log(name: str, replica: int) -> str:
    return (RUN / "logs" / CELL / f"block~{name}" / "replicas" / f"replica-{replica}.log").read_text()


@pytest.fixture(scope="module")
def rows() -> pd.DataFrame:
    return pd.concat([read_records(block(name) / "requests.csv") for name in FINISHED], ignore_index=True)


def test_every_block_ran_the_shipped_128k_config_at_one_clean_commit_on_the_h100():
    config = run_config()
    validated(config, REPO)
    shipped_config = shipped("h100-shape-b-128k.yaml")
    assert config["engine"] == shipped_config["engine"] and config["study_b"]["contexts"] == [CONTEXT]
    for name in [*FINISHED, "4-off"]:  # the fourth block wrote its manifest before the budget stopped it
        manifest = read_json(block(name) / "manifest.json")
        assert manifest["git"] == {"commit": COMMIT, "dirty": False, "source": "KVPOOL_GIT_COMMIT"}
        assert manifest["hardware"]["gpu"]["devices"] == ["NVIDIA H100 80GB HBM3"]
        assert (manifest["versions"]["vllm"], manifest["versions"]["lmcache"]) == ("0.26.0", "0.5.3")
        assert manifest["config"] == config


def test_the_replicas_kept_the_kv_the_32k_run_predicted_and_more_tokens_than_the_longest_request():
    """The config was sized from h100-shape-b's logged weights, peak activation and memory outside torch: each
    replica here logged the same three, and the KV left (5.93 GiB) is the prediction. It holds 179,591 tokens,
    more than the 155K the 32K run's tokens a GiB gave: vLLM counts a hybrid's tokens by max_model_len."""
    shorter, _ = logged_memory((SHORTER / "logs" / "model" / "model_check" / "replica-0" / "replica-0.log").read_text())
    for replica in (0, 1):
        gib, share = logged_memory(replica_log("1-off", replica))
        assert share == 0.47
        assert {key: gib[key] for key in ("weight", "activation")} == {"weight": 27.55, "activation": 3.51}
        assert predicted_kv_gib(run_config(), shorter) == pytest.approx(gib["kv"], abs=0.02)
        assert logged_kv_tokens(replica_log("1-off", replica)) > 1.3 * run_config()["engine"]["max_model_len"]


@pytest.mark.parametrize("name", FINISHED)
def test_each_finished_block_is_valid_by_the_checks_made_again_from_its_records(name):
    recorded = read_json(block(name) / "block.json")
    frame = read_records(block(name) / "requests.csv")
    reference = read_records(block(name) / "reference.csv")  # as the pipeline reads a reference back
    config = run_config()
    again = studyb.block_checks(frame, studyb.block_arm(name), studyb.resolved(config), config["min_hit_fraction"],
                                reference)
    assert_same_gate(recorded["checks"], again, gone={"served_as_planned"})  # served: from the replicas, not rows
    assert recorded["valid"] and all(check["status"] != "failed" for check in recorded["checks"].values())


@pytest.mark.parametrize("name", ["2-on", "3-on"])
def test_every_on_answer_at_128k_equals_a_recompute_in_its_own_split(name):
    value = read_json(block(name) / "block.json")["checks"]["output_matches_recompute"]["value"]
    assert value["compared"] == value["exact"] == 17 and value["unmatched"] == value["reference_inconsistent"] == 0


def test_the_cross_step_loaded_all_131200_tokens_from_the_pool_and_recomputed_them_without(rows):
    cross = rows[(rows["kind"] == "chain") & (rows["step"] == "cross")]
    on, off = cross[cross["arm"] == "on"], cross[cross["arm"] == "off"]
    assert (len(on), len(off)) == (2, 1)
    assert (on["external_hit_tokens"] == CONTEXT).all() and (on["computed_tokens"] == 16).all()
    assert (off["external_hit_tokens"] == 0).all() and (off["computed_tokens"] == CONTEXT + 16).all()
    assert off["ttft_s"].iloc[0] > 20 * on["ttft_s"].max()  # 22.6 s against 0.97 and 0.89 s
    assert rows["error"].isna().all()


def test_the_fourth_block_and_the_tables_are_what_is_left_and_the_folder_can_go_on():
    """What the next machine needs from this folder: every file the run had, at its recorded path, beside the
    digests of the prompts and model it rebuilds (bench/device_resume.sh unpack)."""
    assert not (block("4-off") / "block.json").exists() and not (RUN / "results" / "studyb.md").exists()
    rebuilt = {line[66:] for line in (RUN / "resume" / "SHA256SUMS").read_text().splitlines()}
    assert rebuilt >= {"results/studyb/workload.json", "resources/model/config.json"}
    for line in (RUN / "resume" / "times.tsv").read_text().splitlines():
        path = line.split("\t")[1]
        if path not in rebuilt:
            kept = path.replace(".snakemake/log/", "snakemake-log/")
            assert (RUN / kept).is_file(), kept
