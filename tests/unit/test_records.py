"""The per-request record kinds: their columns, rows, and the one place they are written and read."""

from pathlib import Path

import pandas as pd
import pytest

from kvpool.measure import records
from kvpool.measure.records import ChainRecord, LevelRecord, RequestRecord, RoutedRecord


def test_a_level_record_is_a_request_record_and_when_it_was_due():
    times = records.columns(records.RequestTimes)
    request = [column for column in records.columns(RequestRecord) if column not in times]
    # the times a request carries are every kind's last columns, after its own
    assert records.columns(LevelRecord) == [*request, "level", "due_s", *times]
    assert records.columns(RequestRecord) == [*request, *times] and times[0] == "queue_s"
    assert records.columns(RequestRecord)[:3] == ["doc_id", "prefill_replica", "serve_replica"]


def test_a_row_has_every_column_and_refuses_one_its_kind_does_not_have():
    row = records.row(RoutedRecord, router="cross", phase="first", seq=0)
    assert list(row) == records.columns(RoutedRecord) and row["ttft_s"] is None
    with pytest.raises(KeyError, match="external_hits"):
        records.row(RoutedRecord, router="cross", external_hits=3)


def test_a_frame_has_exactly_its_kinds_columns_even_with_no_rows():
    assert list(records.frame(ChainRecord, []).columns) == records.columns(ChainRecord)
    frame = records.frame(RequestRecord, [{"doc_id": 1, "serve_replica": 0, "stray": 9}])
    assert list(frame.columns) == records.columns(RequestRecord) and frame["doc_id"].tolist() == [1]


def test_written_records_keep_a_timestamped_copy_and_read_back_as_text(tmp_path):
    frame = records.frame(RequestRecord, [{"doc_id": 0, "serve_replica": 1, "error": "", "output_text": "None"}])
    records.write_records(frame, tmp_path / "reuse.csv", "reuse")
    copies = list((tmp_path / "runs").glob("*-reuse.csv"))
    assert len(copies) == 1 and copies[0].read_text() == (tmp_path / "reuse.csv").read_text()
    back = records.read_records(tmp_path / "reuse.csv")
    assert back["error"].isna().all() and back["output_text"].tolist() == ["None"]


def test_an_older_record_reads_with_its_kinds_later_columns_empty(tmp_path):
    older = tmp_path / "reuse.csv"
    pd.DataFrame({"doc_id": [0], "serve_replica": [1], "ttft_s": [0.5]}).to_csv(older, index=False)
    back = records.read_records(older, RequestRecord)
    assert list(back.columns) == records.columns(RequestRecord)
    assert back["ttft_s"].tolist() == [0.5] and back["local_cache_hit_tokens"].isna().all()


def test_a_units_meta_keeps_a_timestamped_copy_beside_its_records(tmp_path):
    level = tmp_path / "load~c4"
    level.mkdir()
    records.write_meta({"level": "c4", "valid": True}, level / "level.json")
    copies = list((level / "runs").glob("*-level.json"))
    assert len(copies) == 1 and copies[0].read_text() == (level / "level.json").read_text()


def test_a_timed_job_keeps_every_output_it_wrote_and_fails_on_one_it_left_unwritten(tmp_path):
    """A job's telemetry, digests and drop records are kept in runs/ as its records are (one copy of
    each), and an output the job did not rewrite (its rule keeps the earlier version in place) fails it."""
    cell = tmp_path / "cell"
    (cell / "telemetry").mkdir(parents=True)
    outputs = [str(cell / "populate.csv"), str(cell / "telemetry" / "populate-drive.csv"), str(cell / "drop.json")]
    with records.measured_outputs(outputs):
        records.write_records(pd.DataFrame({"doc_id": [0]}), outputs[0], "populate")
        (cell / "telemetry" / "populate-drive.csv").write_text("t_s,device\n0.5,sda\n")
        (cell / "drop.json").write_text('{"dropped": true}')
    kept = sorted(path.name.split("-", 1)[1] for path in (cell / "runs").iterdir())
    assert kept == ["drop.json", "populate.csv", "telemetry-populate-drive.csv"]
    (cell / "drop.json").write_text('{"dropped": "earlier"}')
    import os
    import time
    os.utime(cell / "drop.json", (time.time() - 60, time.time() - 60))
    with pytest.raises(RuntimeError, match=r"without writing .*drop\.json; the earlier version is kept"):
        with records.measured_outputs(outputs):
            for path in outputs[:2]:
                Path(path).write_text("new\n")


def test_every_timed_rule_keeps_its_earlier_outputs_until_it_has_measured_again():
    """Snakemake deletes a job's outputs before it runs, so a rerun refused (a busy port) lost a finished
    cell's records: every rule that starts a fleet marks each output update() (kept in place, restored
    if the job fails), and its script checks that it rewrote them all."""
    import re

    from support import REPO

    timed = {}
    for path in (REPO / "workflow" / "rules").glob("*.smk"):
        for block in re.split(r"\n(?=rule )", path.read_text()):
            if "fleet=1" in block:
                name = re.match(r"rule (\w+):", block)[1]
                outputs = re.search(r"\n    output:\n((?:        .*\n)+)", block)[1]
                script = re.search(r'"\.\./scripts/(\w+\.py)"', block)[1]
                timed[name] = ([line.strip() for line in outputs.splitlines() if not line.strip().startswith("#")],
                               (REPO / "workflow" / "scripts" / script).read_text())
    assert {"cell", "populate", "reuse", "load_level", "router_unit", "context_unit", "studyb_block"} <= set(timed)
    for name, (outputs, script) in timed.items():
        assert all(re.match(r"(\w+=)?update\(", line) for line in outputs), (name, outputs)
        assert "with records.measured_outputs(snakemake.output):" in script, name
