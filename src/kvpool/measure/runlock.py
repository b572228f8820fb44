"""One kvpool run per working directory, held for the life of the Snakemake process.

Snakemake's own lock can be removed by any concurrent invocation's ``--unlock``, and a second run
in the same directory would clear the first one's pools mid-measurement. This lock is an flock(2)
on a file in ``.snakemake/``: the kernel drops it when the process ends, however it ends.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = Path(".snakemake") / "kvpool-run.lock"
_HELD: dict[Path, object] = {}  # open lock files: closing one would release its lock


class RunLocked(RuntimeError):
    """Another kvpool run holds this working directory."""


def acquire(workdir: Path):
    """Take the working directory's run lock, held until the process ends (or the returned file is
    closed); raise RunLocked, naming the holder, if another process has it."""
    path = Path(workdir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise RunLocked(f"another kvpool run (pid {holder}) is using {Path(workdir).resolve()}; wait for it or stop "
                        "it: two runs in one working directory would clear each other's pools and records") from None
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    _HELD[path] = handle
    return handle
