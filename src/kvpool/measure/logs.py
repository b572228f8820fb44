"""Logging for pipeline steps: to the rule's log file and, for progress, to the terminal as well."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

from kvpool.engine.errors import Refused


class _Tee:
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for stream in self.streams:
            stream.write(text)
            stream.flush()
        return len(text)

    def flush(self):
        for stream in self.streams:
            stream.flush()

    def isatty(self):
        return False


def to_log(path: str) -> None:
    """Send stderr (logging, tqdm progress, tracebacks) to ``path`` and to the terminal; a refusal
    (kvpool.engine.errors.Refused) ends the job in one line, where anything else keeps its traceback."""
    sys.stderr = _Tee(open(path, "w", buffering=1), sys.__stderr__)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.excepthook = _refusals_in_one_line


def _refusals_in_one_line(kind, error, trace) -> None:
    if issubclass(kind, Refused):
        print(f"kvpool refused: {error}", file=sys.stderr)
    else:
        sys.__excepthook__(kind, error, trace)


# What a full tier looks like in a replica's or pool server's log (LMCache logs a failed store and goes on).
WRITE_ERRORS = re.compile(r"No space left on device|\[Errno 28\]|Disk quota exceeded|\[Errno 122\]")
ANSI_COLOURS = re.compile(r"\x1b\[[0-9;]*m")


def log_sizes(log_dir: Path) -> dict[Path, int]:
    """The size of every log under ``log_dir`` now: where this phase's lines will start (logs append)."""
    return {path: path.stat().st_size for path in Path(log_dir).rglob("*.log")}


def new_lines_matching(log_dir: Path, since: dict[Path, int], pattern: re.Pattern = WRITE_ERRORS,
                       limit: int = 5) -> list[str]:
    """Lines written under ``log_dir`` after ``since`` (from log_sizes) that match ``pattern``, as
    ``file: line``, the first ``limit`` of them, colour codes dropped. A long line is cut to the
    300 characters that end just past the match (LMCache names the whole file path before the cause)."""
    found = []
    for path in sorted(Path(log_dir).rglob("*.log")):
        with open(path, "rb") as handle:
            handle.seek(since.get(path, 0))
            for line in handle.read().decode(errors="replace").splitlines():
                line = ANSI_COLOURS.sub("", line).strip()
                match = pattern.search(line)
                if match and len(found) < limit:
                    shown = line if len(line) <= 300 else "..." + line[max(0, match.end() + 60 - 300):match.end() + 60]
                    found.append(f"{path.name}: {shown}")
    return found
