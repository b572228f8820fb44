"""What the tests that re-read a committed run (docs/results/<run>) do alike: a Study A cell's config and
gate again from its records, a router unit's gate again from its records, the routers and peer tables rebuilt
from the units, and the pipeline's measured_only rebuild of a page in a copy of the run."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from snakemake.utils import validate

from kvpool.cells import Cell
from kvpool.measure.checks import NOT_APPLICABLE, status
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records
from kvpool.report import peer
from kvpool.report import routers as routers_report
from kvpool.report import studyb as studyb_report
from kvpool.studies import routers, study_a, studyb
from support import REPO


def comparable(check: dict):
    """The part of a check that a gate recorded before statuses and today's gate share: the verdict and the
    measured value (thresholds are the checks' own words); a check that could not fail (a cold read on a
    memory tier, recorded then as passed) is "not applicable" in both."""
    values = check.get("value") if isinstance(check.get("value"), list) else [check.get("value")]
    if status(check) == NOT_APPLICABLE or (values and all(str(v).startswith("memory-backed tier") for v in values)):
        return NOT_APPLICABLE
    if isinstance(check.get("value"), dict) and check["value"].get("files") == 0 and check["ok"]:
        return NOT_APPLICABLE  # a pool in a server's memory: no file was hashed, so nothing could change
    return check["ok"], check["value"]


def assert_same_gate(recorded: dict, again: dict, new: set[str] = frozenset(), gone: set[str] = frozenset(),
                     apart: set[str] = frozenset()) -> None:
    """``again`` (today's gate from the records) says what ``recorded`` (the run's) said on every check they
    share; ``new`` names the checks only today's gate makes, ``gone`` those it no longer makes, ``apart``
    those whose value changed form (the caller compares them)."""
    assert set(again) - set(recorded) == set(new), set(again) ^ set(recorded)
    assert set(recorded) - set(again) == set(gone), set(again) ^ set(recorded)
    for name in set(recorded) & set(again) - set(apart):
        assert comparable(recorded[name]) == comparable(again[name]), name


def study_a_cell_dir(run: Path, cell: Cell) -> Path:
    return run / "results" / "cells" / cell.name


def study_a_config(run: Path, cell: Cell) -> dict:
    """The config a committed run's cell recorded (its manifest.json), with today's schema's defaults."""
    config = read_json(study_a_cell_dir(run, cell) / "manifest.json")["config"]
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    return config


def study_a_gate_again(run: Path, cell: Cell, config: dict, out: Path) -> tuple[dict, dict]:
    """A committed Study A cell's gate as recorded and as judged again from its records into ``out``."""
    folder = study_a_cell_dir(run, cell)
    study_a.run_validity(config, cell, populate_csv=folder / "populate.csv", populate_json=folder / "populate.json",
                         reuse_csv=folder / "reuse.csv", reuse_json=folder / "reuse.json",
                         reference_csv=run / "results" / "reference" / "outputs.csv",
                         populate_digests=folder / "populate-digests.csv", reuse_digests=folder / "pool-digests.csv",
                         out=out)
    return read_json(folder / "validity.json"), read_json(out)


def router_unit_dir(run: Path, cell: Cell, router: str) -> Path:
    return run / "results" / "cells" / cell.name / f"router~{router}"


def router_checks_again(run: Path, cell: Cell, router: str) -> tuple[dict, dict, dict]:
    """The unit's run.json, its manifest and its gate as today's code gives it from its records (with the
    run's reference outputs where it kept them)."""
    folder = router_unit_dir(run, cell, router)
    meta, manifest = read_json(folder / "run.json"), read_json(folder / "manifest.json")
    config = manifest["config"]
    reference = run / "results" / "reference" / "outputs.csv"
    again = routers.checks(cell.arm, read_records(str(folder / "requests.csv")), meta["windows"],
                           meta["drop_before_followups"], meta["loss"], config["workload"]["doc_tokens"],
                           config["min_hit_fraction"], config["max_resident_fraction"],
                           read_records(str(reference)) if reference.exists() else None, False,
                           config["routers"]["hot"]["concurrency"])
    return meta, manifest, again


def rebuild_router_table(run: Path, units: list[tuple[Cell, str]], out: Path) -> None:
    """routers.csv, routers.md and the figures from the units' records, into ``out``."""
    routers_report.run_router_table(units, csvs=[str(router_unit_dir(run, c, r) / "requests.csv") for c, r in units],
                                    metas=[str(router_unit_dir(run, c, r) / "run.json") for c, r in units],
                                    csv_out=str(out / "routers.csv"), md_out=str(out / "routers.md"),
                                    figures_dir=str(out / "routers"))


def measured_only_rebuild(run: Path, config: str, target: str, page: str, tmp_path: Path) -> Path:
    """A copy of the run without ``page``, rebuilt by ``snakemake TARGET --config measured_only=True``
    with ``config/CONFIG``; returns the copy, after asserting the rebuild succeeded."""
    work = tmp_path / "run"
    shutil.copytree(run, work)
    (work / page).unlink()
    out = subprocess.run([sys.executable, "-m", "snakemake", target, "--cores", "1", "-s", str(REPO / "Snakefile"),
                          "--directory", str(work), "--configfile", str(REPO / "config" / config), "--config",
                          "measured_only=True"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return work


def assert_peer_table_rebuilt(run: Path, cell: Cell, out: Path) -> None:
    """The run's ``results/peer.csv`` and ``.md`` made again in ``out`` from its cell's reuse phase and every
    replay it finished (``load~peer``, and ``load~peer-descending`` where it has one), equal to the
    committed ones."""
    folder = run / "results" / "cells" / cell.name
    levels = [level for level in ("peer", "peer-descending") if (folder / f"load~{level}" / "level.json").exists()]
    peer.run_peer_table(
        [(cell, level) for level in levels],
        reuse={cell: {"csv": str(folder / "reuse.csv"), "validity": str(folder / "validity.json")}},
        replays={(cell, level): {"csv": str(folder / f"load~{level}" / "requests.csv"),
                                 "meta": str(folder / f"load~{level}" / "level.json")} for level in levels},
        csv_out=str(out / "peer.csv"),
        md_out=str(out / "peer.md"),
    )
    again, committed = (
        pd.read_csv(p, dtype={"replica": str}) for p in (out / "peer.csv", run / "results" / "peer.csv")
    )
    pd.testing.assert_frame_equal(again, committed, rtol=1e-9)
    assert (out / "peer.md").read_text() == (run / "results" / "peer.md").read_text()


def studyb_tables_again(blocks_dir: Path, names: list[str], out: Path) -> tuple[dict, str]:
    """Study B's gate (validity.json) and page (studyb.md) made again in ``out`` from a run's block records in
    ``blocks_dir``, with the config its first block's manifest holds."""
    config = read_json(blocks_dir / f"block~{names[0]}" / "manifest.json")["config"]
    blocks = {name: {"csv": str(blocks_dir / f"block~{name}" / "requests.csv"),
                     "meta": str(blocks_dir / f"block~{name}" / "block.json")} for name in names}
    studyb_report.run_studyb_tables(config, studyb.resolved(config), blocks, locality_csv=str(out / "locality.csv"),
                                    sessions_csv=str(out / "sessions.csv"), summary_csv=str(out / "summary.csv"),
                                    validity_out=str(out / "validity.json"), md_out=str(out / "studyb.md"),
                                    figures_dir=str(out / "studyb" / "figures"))
    return read_json(out / "validity.json"), (out / "studyb.md").read_text()


def logged_memory(log: str) -> tuple[dict, float]:
    """What a replica's vLLM log says of its GPU memory (GiB) and its share of the GPU, the sum checked."""
    gib = {name: float(re.search(pattern, log).group(1)) for name, pattern in {
        "free": r"Free memory on device \(([\d.]+)/", "total": r"Free memory on device \([\d.]+/([\d.]+) GiB",
        "weight": r"([\d.]+) GiB for weight", "activation": r"([\d.]+) GiB for peak activation",
        "outside": r"([\d.]+) GiB for non-torch mem", "kv": r"Available KV cache memory: ([\d.]+) GiB"}.items()}
    share = float(re.search(r"Desired GPU memory utilization is \(([\d.]+),", log).group(1))
    assert share * gib["total"] - gib["weight"] - gib["activation"] - gib["outside"] == pytest.approx(
        gib["kv"], abs=0.01)
    return gib, share


def logged_kv_tokens(log: str) -> int:
    """The tokens of KV a replica's vLLM log says it keeps."""
    return int(re.search(r"GPU KV cache size: ([\d,]+) tokens", log).group(1).replace(",", ""))


def predicted_kv_gib(config: dict, gib: dict) -> float:
    """The KV memory a replica of ``config`` keeps, from another launch's logged weights, activation and the rest."""
    share = config["engine"]["gpu_memory_utilization"] / config["engine"]["replicas_per_gpu"]
    return share * gib["total"] - gib["weight"] - gib["activation"] - gib["outside"]
