"""The folder LMCache's in-process connector keeps a pool in, as it reads it back from the setting kvpool writes.

LMCache 0.5.6 does not take either setting's path verbatim:

- ``remote_url: fs://host:port/PATH`` (lmcache-fs): ``parse_remote_url``
  (lmcache/v1/storage_backend/connector/__init__.py) keeps ``urllib.parse.urlparse(url).path``, so a ``#``
  starts a fragment, a ``?`` a query, and tab, CR and LF are dropped; ``FSConnector``
  (connector/fs_connector.py) then splits that path at ``,`` into several base paths, each stripped.
- ``local_disk: file://PATH`` (lmcache-local-disk): ``_parse_local_disk`` (lmcache/v1/config_base.py)
  splits the value at ``,``, strips each part and its ``file://``; ``PathSharder`` splits it at ``,`` again.

A folder that does not come back whole puts the pool somewhere else (``/dev/shm/x#y/...`` is read as
``/dev/shm/x``): outside the cell's folder, shared by every cell and run, never emptied. So each setting is
read back here the way LMCache reads it, and a folder that does not survive is refused.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from kvpool.cells import Backend

# The backends whose replicas are given their pool's folder inside an LMCache setting (an MP server's L2
# folder is a JSON string and a Redis server's --dir an argument of its own: both are taken verbatim).
FOLDER_BACKENDS = (Backend.FS, Backend.LOCAL_DISK)


def setting(backend: str, folder: Path | str) -> tuple[str, str]:
    """The LMCache config key and value that give ``backend`` its pool ``folder``."""
    if backend == Backend.FS:
        # the port is not used by the fs connector, but parse_remote_url requires one
        return "remote_url", f"fs://localhost:0{folder}/"
    if backend == Backend.LOCAL_DISK:
        return "local_disk", f"file://{folder}/"
    raise ValueError(f"{backend} is not configured with a folder in its URL")


def folders_read(backend: str, value: str) -> list[str]:
    """The folders LMCache keeps ``backend``'s pool in, given its setting ``value``."""
    if backend == Backend.FS:
        path = urlparse(value).path
        return [part.strip() for part in path.split(",")] if "," in path else [path]
    return [part.strip().removeprefix("file://") for part in value.split(",") if part.strip()]


def misread(backend: str, folder: Path | str) -> list[str] | None:
    """The folders LMCache would use instead of the absolute ``folder``, or None where it reads ``folder`` whole."""
    found = folders_read(backend, setting(backend, folder)[1])
    return None if found == [f"{folder}/"] else found
