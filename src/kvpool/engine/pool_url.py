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

# The settings that name a pool's folder: lmcache-fs's remote URL and lmcache-local-disk's folder list (an MP
# server's L2 folder is a JSON string and a Redis server's --dir an argument of its own: both are taken verbatim).
REMOTE_URL, LOCAL_DISK = "remote_url", "local_disk"


def setting(key: str, folder: Path | str) -> tuple[str, str]:
    """The LMCache config ``key`` and its value that give a pool the ``folder``."""
    if key == REMOTE_URL:
        # the port is not used by the fs connector, but parse_remote_url requires one
        return key, f"fs://localhost:0{folder}/"
    if key == LOCAL_DISK:
        return key, f"file://{folder}/"
    raise ValueError(f"{key} does not name a pool folder")


def folders_read(key: str, value: str) -> list[str]:
    """The folders LMCache keeps a pool in, given setting ``key``'s ``value``."""
    if key == REMOTE_URL:
        path = urlparse(value).path
        return [part.strip() for part in path.split(",")] if "," in path else [path]
    return [part.strip().removeprefix("file://") for part in value.split(",") if part.strip()]


def misread(key: str, folder: Path | str) -> list[str] | None:
    """The folders LMCache would use instead of the absolute ``folder``, or None where it reads ``folder`` whole."""
    found = folders_read(key, setting(key, folder)[1])
    return None if found == [f"{folder}/"] else found
