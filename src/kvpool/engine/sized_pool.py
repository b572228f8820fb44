"""A pool folder of a fixed size: the capacity limit of a pool of files (``lmcache-fs``).

LMCache's fs connector has no size limit of its own, so a capacity unit mounts a filesystem of the
capacity's size over the shared pool folder for the unit's life:

- on a memory tier, a tmpfs whose ``size`` is the capacity, rounded down to whole pages;
- on a drive tier, an ext4 image on that tier (sparse, no journal, no reserved blocks) mounted through a
  loop device, with a preallocated filler file that leaves exactly the capacity free, rounded down to
  whole blocks, so the pool's reads and writes reach the tier's drive.

Nothing is evicted: once the filesystem is full, a store fails (the connector removes its temp file and
logs ``Failed to write file``), and what the pool holds is the chunk files that landed. Mounting needs
root (``mount``); ``problems`` names what is missing before anything runs. Commands are argument lists.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import psutil

from kvpool.engine.pool_files import is_memory_backed

log = logging.getLogger(__name__)

FILLER = ".kvpool-capacity-filler"  # the drive tier's preallocated file that keeps the free space at the capacity
BLOCK = 4096
PAGE = os.sysconf("SC_PAGE_SIZE")


def image_bytes(limit: int) -> int:
    """The ext4 image for ``limit`` free bytes: the limit plus room for ext4's own metadata (its inode
    tables and group descriptors, about 2% at 4 KiB blocks) and a margin; the filler takes the rest."""
    return (limit + limit // 16 + 64 * 2**20) // BLOCK * BLOCK


def filler_bytes(free: int, limit: int) -> int:
    """The filler that leaves at most ``limit`` bytes free of ``free``: whole blocks, rounded up."""
    return max(0, -(-(free - limit) // BLOCK) * BLOCK)


def free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def problems(tiers: dict[str, Path]) -> list[str]:
    """What keeps a sized pool folder from being mounted on these tiers (name: folder), on this host."""
    found = []
    needs = ["mount", "umount"] + (["mkfs.ext4"] if any(not is_memory_backed(p) for p in tiers.values()) else [])
    missing = [tool for tool in needs if shutil.which(tool) is None]
    if missing:
        found.append(f"capacity on a pool of files needs {', '.join(missing)} on PATH (a filesystem of the "
                     "capacity's size is mounted over the pool folder)")
    if os.geteuid() != 0:
        found.append("capacity on a pool of files mounts a filesystem of the capacity's size over the pool folder, "
                     f"which needs root (this process runs as uid {os.geteuid()}); run as root, or measure capacity "
                     "on lmcache-redis or lmcache-mp")
    return found


def _run(argv: list[str], what: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({' '.join(argv)}, status {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()}")


@contextlib.contextmanager
def sized_folder(folder: Path, limit: int):
    """``folder`` (an existing, empty pool folder) with at most ``limit`` bytes free for the pool while the
    context lasts; yields what was mounted (kind, size, free bytes). Unmounted however the context ends,
    the drive tier's image removed."""
    folder = Path(folder)
    memory = is_memory_backed(folder)
    image = folder.parent / f".{folder.name}.ext4"
    if memory:
        size = limit // PAGE * PAGE
        _run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "kvpool-capacity", str(folder)],
             f"mounting a {size:,}-byte tmpfs at {folder}")
    else:
        with open(image, "wb") as f:
            f.truncate(image_bytes(limit))
        try:
            _run(["mkfs.ext4", "-F", "-q", "-m", "0", "-b", str(BLOCK), "-O", "^has_journal", str(image)],
                 f"making an ext4 image at {image}")
            _run(["mount", "-o", "loop", str(image), str(folder)],
                 f"mounting {image} at {folder} through a loop device")
        except BaseException:
            image.unlink(missing_ok=True)
            raise
    try:
        if not memory:
            filler = folder / FILLER
            with open(filler, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, max(BLOCK, filler_bytes(free_bytes(folder), limit)))
        stat = os.statvfs(folder)
        mounted = {"kind": "tmpfs" if memory else "ext4 on a loop device", "limit_bytes": limit,
                   "free_bytes": stat.f_bavail * stat.f_frsize, "size_bytes": stat.f_blocks * stat.f_frsize}
        if mounted["free_bytes"] > limit:
            raise RuntimeError(f"the sized pool folder {folder} has {mounted['free_bytes']:,} bytes free, more than "
                               f"its capacity of {limit:,}")
        log.info("pool folder %s: %s with %s bytes free (capacity %s)", folder, mounted["kind"],
                 f"{mounted['free_bytes']:,}", f"{limit:,}")
        yield mounted
    finally:
        _unmount(folder)
        image.unlink(missing_ok=True)


def release_stale(root: Path) -> list[str]:
    """Unmount what an earlier unit killed before its end (SIGKILL) left mounted under ``root``, so its pool
    folder can be emptied; returns the mount points released."""
    root = Path(root).resolve()
    stale = [part.mountpoint for part in psutil.disk_partitions(all=True)
             if Path(part.mountpoint).is_relative_to(root) and Path(part.mountpoint) != root]
    for mountpoint in sorted(stale, reverse=True):
        log.warning("a sized pool folder was left mounted at %s (an earlier unit ended before unmounting it): "
                    "unmounting it", mountpoint)
        _unmount(Path(mountpoint))
    return stale


def _unmount(folder: Path) -> None:
    """Unmount ``folder``; a mount still busy (a replica's open file as it stops) is detached lazily, so it
    goes once its last user does."""
    done = subprocess.run(["umount", str(folder)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        log.warning("umount %s: %s; detaching it lazily", folder, done.stderr.strip())
        _run(["umount", "-l", str(folder)], f"detaching {folder}")
