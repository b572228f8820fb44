"""What ``measured_only`` refuses to judge again: a measured cell whose run recorded other settings than the
config now given, and a measured cell the config's matrix leaves out (the Snakefile names both before any step
runs)."""

from __future__ import annotations

from pathlib import Path

from kvpool.cells import Cell
from kvpool.matrix import cells
from kvpool.measure.files import read_json
from kvpool.settings import step_settings
from kvpool.studies.study_a import run_validity


def _differing(given, recorded, key: str) -> list[str]:
    """The dotted keys under ``key`` whose values differ; a key the record lacks (a run from before it
    existed) is not compared."""
    if isinstance(given, dict) and isinstance(recorded, dict):
        return [found for sub in given if sub in recorded
                for found in _differing(given[sub], recorded[sub], f"{key}.{sub}")]
    return [] if given == recorded else [key]


def judged_otherwise(config: dict, cells: list[Cell], workdir: Path, steps=None) -> list[str]:
    """With measured_only: each cell whose run recorded (its manifest.json) other values than ``config``
    for what ``steps`` read (their declared settings; by default the gate's, ``run_validity``), with the
    keys that differ. Judging or tabling it again with ``config`` would overwrite its verdict or its row
    with one its run never had."""
    given = [step_settings(step, config) for step in (steps or (run_validity,))]
    found = []
    for cell in cells:
        manifest = workdir / "results" / "cells" / cell.name / "manifest.json"
        if not manifest.exists():
            continue
        recorded = read_json(manifest).get("config", {})
        keys = list(dict.fromkeys(k for read in given for section in read if section in recorded
                                  for k in _differing(read[section], recorded[section], section)))
        if keys:
            found.append(f"{cell.name}: {', '.join(keys)} (this config: "
                         + "; ".join(f"{k} {_at(config, k)!r}, the run's {_at(recorded, k)!r}" for k in keys) + ")")
    return found


# The keys of the matrix, each with what a cell holds of it
MATRIX_KEYS = {"backends": lambda cell: cell.backend, "arms": lambda cell: cell.arm,
               "chunk_sizes": lambda cell: cell.chunk, "tiers": lambda cell: cell.tier}


def left_out(config: dict, workdir: Path) -> list[str]:
    """With measured_only: each cell whose reuse phase finished in ``workdir`` that ``config``'s matrix
    leaves out, with the matrix keys that leave it out and its run's values (its manifest.json). The run's
    gate judged it, and compared its pool's bytes with its other arm's; a gate over the rest alone would
    pass where the run's failed."""
    matrix = set(cells(config))
    root = workdir / "results" / "cells"
    found = []
    for reuse in sorted(root.glob("backend~*/arm~*/chunk~*/tier~*/reuse.json")):
        try:
            cell = Cell.from_name(reuse.parent.relative_to(root).as_posix())
        except ValueError:  # no folder of a cell kvpool names
            continue
        if cell in matrix:
            continue
        manifest = reuse.parent / "manifest.json"
        recorded = read_json(manifest).get("config", {}) if manifest.exists() else {}
        keys = [key for key, value in MATRIX_KEYS.items() if value(cell) not in config[key]]
        why = "; ".join(f"{key} {list(config[key])!r}"
                        + (f", the run's {list(recorded[key])!r}" if key in recorded else "")
                        for key in keys) or "not a cell of this config's matrix (its server settings)"
        found.append(f"{cell.name} ({why})")
    return found


def _at(config: dict, key: str):
    for part in key.split("."):
        config = config[part]
    return config
