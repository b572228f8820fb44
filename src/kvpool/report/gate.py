"""The run's gate: every unit's verdict in one table, and the run failed, last, if any unit is invalid or
any KV bytes differ where they must agree."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvpool.measure import kvbytes, legacy, validity
from kvpool.measure.checks import NOT_APPLICABLE, NOT_VERIFIED, status, tally
from kvpool.measure.files import read_json
from kvpool.studies.peer import ORDERS, cell_rows, level_name
from kvpool.studies.studyb import gate_failures


def run_validity_table(validity_jsons: list[str], out: str) -> None:
    """results/validity.csv: each cell's verdict, the checks it rests on (passed, failed), the reasons of a
    failure, and the checks that were not applicable or not verified, by name."""
    rows = []
    for path in validity_jsons:
        record = read_json(path)

        named = {wanted: [name for name, check in record["checks"].items() if status(check) == wanted]
                 for wanted in (NOT_APPLICABLE, NOT_VERIFIED)}
        counts = tally(record["checks"])
        rows.append({"cell": record["cell"], "valid": record["valid"], "checks_passed": counts["passed"],
                     "checks_failed": counts["failed"], "reasons": "; ".join(validity.failures(record)),
                     "not_verified": "; ".join([*legacy.kept_apart_unverified(record), *named[NOT_VERIFIED]]),
                     "not_applicable": "; ".join(named[NOT_APPLICABLE])})
    pd.DataFrame(rows, columns=VALIDITY_COLUMNS).to_csv(out, index=False)


VALIDITY_COLUMNS = ["cell", "valid", "checks_passed", "checks_failed", "reasons", "not_verified", "not_applicable"]


def gate(validity_csv: str | None, kv_bytes_csv: str | None, out: str, load_csv: str | None = None,
         studyb_json: str | None = None, peer_csv: str | None = None, routers_csv: str | None = None,
         contexts_csv: str | None = None, capacity_csv: str | None = None, trace_csv: str | None = None) -> None:
    """Fail, naming every invalid cell and every setting whose pools hold chunks that differ where they
    must agree bit for bit, and why; the measured data stays where it is. A run of capacity units alone has
    no cells (``validity_csv`` None)."""
    table = (pd.read_csv(validity_csv, keep_default_na=False) if validity_csv is not None
             else pd.DataFrame(columns=["cell", "valid", "reasons"]))
    lines, counted, invalid, damaged, study = judge(table, kv_bytes_csv, load_csv, studyb_json, peer_csv,
                                                    routers_csv, contexts_csv, capacity_csv, trace_csv)
    if lines:
        failed = (f"{len(invalid)} of {len(table)} cells (or their load levels)" if len(table)
                  else f"{len(lines)} units (the run has no cell)")
        raise SystemExit(
            f"{failed} failed the validity gate, {len(damaged)} KV byte comparisons found damage, and Study B's "
            f"blocks are {'not run' if study is None else 'valid' if study['valid'] else 'INVALID'} "
            "(data kept; the tables, results/kv_bytes.md, results/studyb.md and results/report.html show them):\n"
            + "\n".join(lines))
    Path(out).write_text(f"{len(table)} cells valid ({_rests_on(table)}); no KV bytes differ where they must agree"
                         + "".join(f"; {unit} valid" for unit in counted)
                         + ("; Study B's blocks valid" if study is not None else "") + "\n")


def judge(table: pd.DataFrame, kv_bytes_csv: str | None, load_csv: str | None = None,
          studyb_json: str | None = None, peer_csv: str | None = None, routers_csv: str | None = None,
          contexts_csv: str | None = None, capacity_csv: str | None = None, trace_csv: str | None = None
          ) -> tuple[list[str], list[str], pd.DataFrame, pd.DataFrame, dict | None]:
    """The run's verdict, for the gate and the report page alike: a line per failure (an invalid cell, load
    level, replay, router or length unit, damaged KV bytes, Study B), the units beyond the cells it rests on,
    the invalid cells, the damaged comparisons and Study B's record."""
    invalid = table[~table["valid"].astype(bool)]
    damaged = (kvbytes.unexpected(pd.read_csv(kv_bytes_csv, keep_default_na=False))
               if kv_bytes_csv is not None else pd.DataFrame())
    lines = [f"  {row.cell}: {row.reasons}" for row in invalid.itertuples()]
    counted = []  # the units beyond the cells that the verdict also rests on, for the gate's line
    if load_csv is not None:  # the load levels beyond reuse (c1 is the cell's own gate, above)
        levels = pd.read_csv(load_csv)
        beyond = levels[levels["level"] != "c1"] if len(levels) else levels
        if len(beyond):
            unverified = int((beyond.get("outputs_checked", pd.Series(dtype=str)) == "not_verified").sum())
            counted.append(f"{len(beyond)} load levels ({unverified} with answers not verified)")
        bad_levels = beyond[~beyond["valid"].astype(bool)] if len(beyond) else beyond
        lines += [f"  {row.cell} load~{row.level}: its level.json names the failed checks"
                  for row in bad_levels.itertuples()]
        invalid = pd.concat([invalid, bad_levels[["cell"]]]) if len(bad_levels) else invalid
    if peer_csv is not None:  # vLLM's replay of a cell: an invalid one measured something else
        replays = pd.read_csv(peer_csv, dtype={"replica": str})
        replays = replays[cell_rows(replays)] if len(replays) else replays
        bad = replays[~replays["valid"].astype(bool)] if len(replays) else replays
        lines += [f"  {row.cell} load~{level_name(getattr(row, 'order', ORDERS[0]))}: the cell or vllm bench serve's "
                  f"replay of it is invalid (its level.json names the failed checks)" for row in bad.itertuples()]
    # the unit kinds beyond the cells, each judged by its own table, one unit per cell and value of its column (the
    # routers table has a row per phase and group): (table, that column, how a unit is named in its folder, the
    # record naming its failed checks, the kind's name in the gate's line)
    unit_kinds = [
        # a router unit whose pool missed, leaked, or whose tokens are unattributed
        (routers_csv, "router", lambda row: f"router~{row.router}", "run.json", "router"),
        # a length's unit whose chain missed the pool, read warm, or answered apart
        (contexts_csv, "context", lambda row: f"doc~{row.context}", "unit.json", "length"),
        # a capacity unit that erred, missed silently, or held more than allowed
        (capacity_csv, "fraction", lambda row: f"capacity~{row.fraction:g}", "unit.json", "capacity"),
        # a trace unit that erred, missed silently, leaked, or answered apart
        (trace_csv, "router", lambda row: f"trace~{row.router}", "run.json", "trace"),
    ]
    for csv, column, name, record, kind in unit_kinds:
        if csv is None:
            continue
        units = pd.read_csv(csv).drop_duplicates(["cell", column])
        bad = units[~units["valid"].astype(bool)]
        lines += [f"  {row.cell} {name(row)}: its {record} names the failed checks" for row in bad.itertuples()]
        invalid = pd.concat([invalid, bad[["cell"]]]) if len(bad) else invalid
        counted.append(f"{len(units)} {kind} units")
    lines += [f"  backend~{row.backend}/chunk~{row.chunk}/tier~{row.tier}: kv_bytes {row.comparison}: {row.differ} of "
              f"{row.keys} chunks differ where they must agree bit for bit (e.g. {row.example_key})"
              for row in damaged.itertuples()]
    study = read_json(studyb_json) if studyb_json is not None else None
    if study is not None and not study["valid"]:
        lines += [f"  Study B {reason} (results/studyb.md)" for reason in gate_failures(study)]
    return lines, counted, invalid, damaged, study


def _rests_on(table: pd.DataFrame) -> str:
    """What the cells' verdicts rest on, from results/validity.csv: passed checks per cell and the
    checks that were not applicable or not verified, counted."""
    if "checks_passed" not in table or table.empty:
        return "checks not counted in this table"

    def count(column: str) -> int:
        return sum(len([name for name in str(value).split("; ") if name]) for value in table[column])

    passed = table["checks_passed"].astype(int)
    span = f"{passed.min()}" if passed.min() == passed.max() else f"{passed.min()}-{passed.max()}"
    return (f"each on {span} passed checks; {count('not_applicable')} not applicable, "
            f"{count('not_verified')} not verified")
