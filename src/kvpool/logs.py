"""Logging for pipeline steps: to the rule's log file and, for progress, to the terminal as well."""

from __future__ import annotations

import logging
import sys


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
    """Send stderr (logging, tqdm progress, tracebacks) to ``path`` and to the terminal."""
    sys.stderr = _Tee(open(path, "w", buffering=1), sys.__stderr__)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
