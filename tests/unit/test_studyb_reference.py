"""Study B's predicted pool splits: an OFF block computes, on its own pool-less replicas, the splits the ON
blocks after it will run in and it did not, so an ON block starts no reference replica of its own."""

import asyncio
from pathlib import Path

import pandas as pd
import pytest
from support.studyb_standin import StandIn

from kvpool.measure import records, reference
from kvpool.measure.records import ChainRecord, read_records
from kvpool.studies import studyb
from kvpool.studies.studyb_reference import known_answers, predicted_pool_splits

VOCAB = list(range(1000, 3000))
COMMITTED = (Path(__file__).resolve().parents[2] / "docs/results/cpu-studyb/results/studyb"
             / "backend~lmcache-fs/chunk~256/tier~ram")


@pytest.fixture
def study(config):
    config["study_b"].update(contexts=[256, 512], sessions=2, turns=6, session_tokens=300, turn_tokens=100,
                             warmups=1, question_tokens=8, windows=[])
    return studyb.resolved(config)


def blocks_of(study) -> dict[str, pd.DataFrame]:
    workload = studyb.make_workload(VOCAB, study, replicas=2)
    rows = {}
    for block in ("1-off", "2-on"):
        fleet = StandIn(study["chunk"], pooled=studyb.block_arm(block) == studyb.ON)
        rows[block] = records.frame(ChainRecord, asyncio.run(studyb.run_block(fleet.send, block, workload, study, 2)))
    return rows


def unmatched(on: pd.DataFrame, off_requests: list[str] | pd.DataFrame) -> set[tuple[str, int]]:
    known = (known_answers(off_requests, studyb.OFF) if isinstance(off_requests, list)
             else reference.twin_rows(off_requests.assign(key=off_requests["payload_sha256"]), "off_block"))
    return set(reference.missing(studyb.under_test(on), known))


def test_the_off_block_predicts_exactly_the_splits_its_answers_leave_the_on_block(study):
    rows = blocks_of(study)
    predicted = predicted_pool_splits(rows["1-off"], study["chunk"])
    assert predicted and set(predicted) == unmatched(rows["2-on"], rows["1-off"])
    # only the alternating sessions' turns on the other replica: a fixed session's own cache holds more
    on = rows["2-on"].set_index("payload_sha256")
    assert set(on.loc[[key for key, _ in predicted], "placement"]) == {"alternating"}


def test_a_committed_cpu_run_needed_exactly_the_predicted_splits():
    off = read_records(COMMITTED / "block~1-off" / "requests.csv")
    predicted = predicted_pool_splits(off, 256)
    assert sorted(split for _, split in predicted) == [1024, 1024, 1280, 1280, 1536, 1536]
    for block in ("2-on", "3-on"):
        on = read_records(COMMITTED / f"block~{block}" / "requests.csv")
        assert unmatched(on, [str(COMMITTED / "block~1-off" / "requests.csv")]) == set(predicted)


def test_nothing_is_predicted_where_the_off_blocks_own_cache_gave_as_much(study):
    off = blocks_of(study)["1-off"]
    fixed = off[off["placement"] != "alternating"]
    assert predicted_pool_splits(fixed, study["chunk"]) == []
    failed = off.assign(error="connection reset")
    assert predicted_pool_splits(failed, study["chunk"]) == []


def test_an_off_block_computes_for_the_on_blocks_only_where_an_on_block_follows_it():
    assert [studyb.block_position(name) for name in studyb.blocks({"repeats": 2})] == [0, 1, 2, 3] * 2
    follows = [studyb.block_arm(name) == studyb.OFF and studyb.ON in studyb.SEQUENCE[studyb.block_position(name) + 1:]
               for name in studyb.blocks({"repeats": 2})]
    assert follows == [True, False, False, False] * 2


def test_predicted_rows_in_an_off_blocks_reference_count_as_known(tmp_path):
    predicted = pd.DataFrame([{"key": "k", "path": "predicted_on", "requested_split": 512, "achieved_split": 512,
                               "prompt_tokens": 600, "output_text": "a b", "error": ""}])
    predicted.to_csv(tmp_path / "reference.csv", index=False)
    known = known_answers([str(tmp_path / "reference.csv")], studyb.OFF)
    measured = pd.DataFrame([{"key": "k", "cached_tokens": 512, "output_text": "a b", "error": ""}])
    assert reference.missing(measured, known) == []
    assert reference.missing(measured.assign(cached_tokens=256), known) == [("k", 256)]

