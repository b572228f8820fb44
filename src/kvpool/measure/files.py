"""Reading and writing the files a cell folder holds, one way for every step and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd


def write_json(path, data) -> None:
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")


def read_json(path) -> dict:
    return json.loads(Path(path).read_text())


def read_frame_or_empty(path) -> pd.DataFrame:
    """A telemetry CSV; a phase on a memory tier samples no drive and leaves it empty."""
    try:
        return pd.read_csv(path)
    except pd.errors.EmptyDataError:
        return pd.DataFrame()
