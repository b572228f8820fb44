"""The pool on its tier: size, page-cache eviction, and proof that reuse reads come off the device."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

import psutil

MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "hugetlbfs"}
# LMCache writes a chunk file under this suffix and renames it once whole: one still there is a store under way.
TEMP_SUFFIX = ".tmp"
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value


def pool_files(dirs: list[Path]) -> list[Path]:
    """Every regular file under the distinct pool directories."""
    files = []
    for directory in dict.fromkeys(Path(d) for d in dirs):
        if directory.exists():
            files += sorted(p for p in directory.rglob("*") if p.is_file())
    return files


def corrupt(path: Path) -> dict:
    """Flip every byte of the middle quarter of ``path`` (fault injection: a stored chunk that no longer
    holds the KV that was stored). Returns what was changed."""
    size = path.stat().st_size
    start, length = size * 3 // 8, max(size // 4, 1)
    with open(path, "r+b") as f:
        f.seek(start)
        data = bytearray(f.read(length))
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in data))
        f.flush()
        os.fsync(f.fileno())
    return {"file": str(path), "offset": start, "bytes": len(data)}


def filesystem_type(path: Path) -> str:
    """The filesystem type of the mount that holds ``path`` (longest matching mount point)."""
    path = Path(path).resolve()
    best, fstype = "", "unknown"
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint.rstrip("/") or "/"
        if (str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, fstype = mount, part.fstype
    return fstype


def is_memory_backed(path: Path) -> bool:
    """True for tiers whose bytes live in RAM (tmpfs, ramfs): no device read exists to force."""
    return filesystem_type(path) in MEMORY_FILESYSTEMS


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` now in the page cache, by mincore(2) over a read-only shared mapping."""
    size = path.stat().st_size
    if size == 0:
        return 0
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            raise _errno_error(f"mmap of {path}")
        try:
            vector = (ctypes.c_ubyte * ((size + page - 1) // page))()
            if _libc.mincore(address, size, vector) != 0:
                raise _errno_error(f"mincore of {path}")
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)
    return min(size, sum(flag & 1 for flag in vector) * page)


def _errno_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what} failed: {os.strerror(err)}")


def residency(dirs: list[Path]) -> dict:
    """Pool files, bytes and page-cache-resident bytes under ``dirs``."""
    files = pool_files(dirs)
    total = sum(p.stat().st_size for p in files)
    resident = sum(resident_bytes(p) for p in files)
    return {"files": len(files), "bytes": total, "resident_bytes": resident,
            "resident_fraction": resident / total if total else 0.0}


def drop_from_page_cache(dirs: list[Path], use_proc_drop_caches: bool = False) -> dict:
    """fsync every pool file, evict it with POSIX_FADV_DONTNEED (and drop_caches if asked), then verify.

    fadvise and drop_caches only evict clean pages, hence the fsync first.
    """
    files = pool_files(dirs)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    proc_drop = "not requested"
    if use_proc_drop_caches:
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            proc_drop = "done"
        except OSError as exc:
            proc_drop = f"failed: {exc.strerror}"
    record = residency(dirs)
    record["proc_drop_caches"] = proc_drop
    record["memory_backed"] = any(is_memory_backed(Path(d)) for d in dirs if Path(d).exists())
    record["filesystems"] = sorted({filesystem_type(Path(d)) for d in dirs})
    return record
