"""Every committed run's per-request records have their kind's columns (kvpool.measure.records): the kinds
describe what was written, and a record read back with its kind loses nothing."""

import pytest
from support import REPO

from kvpool.measure import records
from kvpool.measure.records import ChainRecord, LevelRecord, RequestRecord, RoutedRecord

KINDS = {"populate.csv": RequestRecord, "reuse.csv": RequestRecord}
RESULTS = REPO / "docs" / "results"


def kind_of(path):
    if path.name in KINDS:
        return KINDS[path.name]
    if path.name != "requests.csv":
        return None
    folder = path.parent.name
    if folder.startswith("load~"):
        return LevelRecord
    if folder.startswith("router~"):
        return RoutedRecord
    if folder.startswith(("block~", "doc~")):
        return ChainRecord
    return None


FILES = sorted(p for p in RESULTS.rglob("*.csv") if "runs" not in p.parts and kind_of(p))


def test_the_committed_runs_hold_records_of_every_kind():
    assert {kind_of(p) for p in FILES} == {RequestRecord, LevelRecord, RoutedRecord, ChainRecord}


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(RESULTS)))
def test_a_committed_record_has_no_column_its_kind_lacks(path):
    kind = kind_of(path)
    written = list(records.read_records(path).columns)
    assert [c for c in written if c not in records.columns(kind)] == []
    assert set(written) >= {c for c in records.columns(kind)[:4]}
