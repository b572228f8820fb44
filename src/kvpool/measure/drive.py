"""The drive behind a tier: which block devices hold it, and what they did (iostat's arithmetic on /proc/diskstats)."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

SECTOR_BYTES = 512  # /proc/diskstats counts 512-byte sectors whatever the device's own sector size
# /proc/diskstats fields after major, minor and name (Documentation/admin-guide/iostats.rst).
DISKSTATS_FIELDS = ["rd_ios", "rd_merges", "rd_sectors", "rd_ticks_ms", "wr_ios", "wr_merges", "wr_sectors",
                    "wr_ticks_ms", "in_flight", "io_ticks_ms", "time_in_queue_ms"]


def read_diskstats(text: str, devices: set[str] | None = None) -> dict[str, dict[str, int]]:
    """Counters per device name from the text of /proc/diskstats (only ``devices`` when given)."""
    stats = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 14 or not parts[0].isdigit() or (devices is not None and parts[2] not in devices):
            continue
        stats[parts[2]] = dict(zip(DISKSTATS_FIELDS, map(int, parts[3:14]), strict=False))
    return stats


def iostat(samples: pd.DataFrame) -> pd.DataFrame:
    """iostat -x per interval from raw counter samples (columns ``t_s``, ``device`` and the counters).

    Each output row covers the interval ending at its ``t_s``; rates use sysstat's formulas:
    r/s = reads/dt, rMB/s = sectors*512/1e6/dt, rareq-sz = read kB per read, r_await = read ms per
    read, aqu-sz = weighted queue ms/elapsed ms, %util = busy ms/elapsed ms.
    """
    out = []
    for device, group in samples.sort_values("t_s").groupby("device", sort=False):
        d = group[["t_s", *DISKSTATS_FIELDS]].diff().iloc[1:]
        dt = d["t_s"]
        rows = pd.DataFrame({"t_s": group["t_s"].iloc[1:].to_numpy(), "device": device}, index=d.index)
        for kind in ("rd", "wr"):
            letter = kind[0]
            ios, sectors, ticks = d[f"{kind}_ios"], d[f"{kind}_sectors"], d[f"{kind}_ticks_ms"]
            rows[f"{letter}_per_s"] = ios / dt
            rows[f"{letter}_mb_per_s"] = sectors * SECTOR_BYTES / 1e6 / dt
            rows[f"{letter}areq_kb"] = (sectors * SECTOR_BYTES / 1024 / ios).where(ios > 0)
            rows[f"{letter}_await_ms"] = (ticks / ios).where(ios > 0)
            rows[f"{letter}_ios"] = ios
            rows[f"{letter}_bytes"] = sectors * SECTOR_BYTES
        rows["aqu_sz"] = d["time_in_queue_ms"] / (dt * 1000)
        rows["util_pct"] = 100 * d["io_ticks_ms"] / (dt * 1000)
        for column in ("phase", "cell"):
            if column in group:
                rows[column] = group[column].iloc[1:].to_numpy()
        out.append(rows)
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame()


def block_devices(path: Path, sys_root: Path = Path("/sys")) -> dict:
    """The block devices holding ``path``: the device of its filesystem, and the whole disks beneath it.

    Partitions resolve to their disk; device-mapper and md devices to the devices in ``slaves/``.
    Memory filesystems and other anonymous devices (major 0) have none, which is recorded as such.
    """
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    record = {"path": str(path), "dev": f"{major}:{minor}", "device": None, "disks": []}
    link = sys_root / "dev" / "block" / f"{major}:{minor}"
    if major == 0 or not link.exists():
        record["note"] = "no block device (memory-backed or virtual filesystem)"
        return record
    node = link.resolve()
    record["device"] = node.name
    record["disks"] = sorted(_whole_disks(node))
    record["models"] = {disk: _model(disk, sys_root) for disk in record["disks"]}
    return record


def _model(disk: str, sys_root: Path) -> str | None:
    """The drive's model string where the kernel exposes one (NVMe, SATA, SCSI; not virtio)."""
    device = sys_root / "block" / disk / "device"
    for path in (device / "model", device / "device" / "model"):
        if path.exists():
            return path.read_text().strip()
    return None


def _whole_disks(node: Path) -> set[str]:
    if (node / "partition").exists():
        return {node.parent.name}
    slaves = node / "slaves"
    members = [p.resolve() for p in slaves.iterdir()] if slaves.is_dir() else []
    if not members:
        return {node.name}
    found = set()
    for member in members:
        found |= _whole_disks(member)
    return found


KELVIN = 273.15


def parse_smart_log(text: str) -> dict:
    """Health fields of ``nvme smart-log -o json`` (nvme-cli 1.x and 2.x key names)."""
    import json

    data = json.loads(text)

    def first(*keys):
        for key in keys:
            if key in data:
                return data[key]
        return None

    kelvin = first("temperature")
    return {
        "temperature_c": None if kelvin is None else round(float(kelvin) - KELVIN, 2),
        "percent_used": first("percent_used", "percentage_used"),
        "avail_spare": first("avail_spare", "available_spare"),
        "data_units_read": first("data_units_read"),
        "data_units_written": first("data_units_written"),
        "media_errors": first("media_errors"),
        "critical_warning": first("critical_warning"),
    }


def drive_health(disk: str, sys_root: Path = Path("/sys"), run=None) -> dict:
    """Composite temperature from hwmon (no root needed) and, where nvme-cli is installed and
    permitted, the SMART log. Missing sources say why; nothing is reported as zero."""
    import shutil
    import subprocess

    run = run or subprocess.run
    record: dict = {"disk": disk}
    sensors = sorted((sys_root / "block" / disk / "device").glob("hwmon*/temp1_input"))
    sensors += sorted((sys_root / "block" / disk / "device" / "device").glob("hwmon/hwmon*/temp1_input"))
    if sensors:
        record["hwmon_temperature_c"] = int(sensors[0].read_text()) / 1000
    else:
        record["hwmon_unavailable"] = "no hwmon temperature sensor for this disk"
    if not disk.startswith("nvme"):
        record["smart_log_unavailable"] = "not an NVMe device"
    elif shutil.which("nvme") is None:
        record["smart_log_unavailable"] = "nvme-cli is not installed"
    else:
        out = run(["nvme", "smart-log", f"/dev/{disk}", "-o", "json"], capture_output=True, text=True, check=False)
        if out.returncode == 0:
            record["smart_log"] = parse_smart_log(out.stdout)
        else:
            record["smart_log_unavailable"] = (out.stderr or out.stdout).strip()[:300]
    return record


def sequential_read_ceiling(directory: Path, size_bytes: int, block_bytes: int = 4 << 20) -> dict:
    """Sequential-read GB/s of a scratch file of ``size_bytes`` in ``directory``, read cold. The file is
    this process's own (``ceiling-<pid>.scratch``), so two runs measuring one tier never share it.

    fio (direct I/O) when installed; else a Python reader with O_DIRECT where the filesystem allows it,
    falling back to buffered reads of a file evicted from the page cache.
    """
    import json
    import mmap
    import shutil
    import subprocess
    import time

    directory.mkdir(parents=True, exist_ok=True)
    scratch = directory / f"ceiling-{os.getpid()}.scratch"
    try:
        if shutil.which("fio"):
            out = subprocess.run(["fio", "--name=ceiling", f"--filename={scratch}", "--rw=read", "--direct=1",
                                  f"--bs={block_bytes}", f"--size={size_bytes}", "--iodepth=32", "--ioengine=libaio",
                                  "--output-format=json"], capture_output=True, text=True, check=True)
            job = json.loads(out.stdout)["jobs"][0]["read"]
            return {"method": "fio direct", "bytes": job["io_bytes"], "gb_per_s": job["bw_bytes"] / 1e9}
        chunk = os.urandom(block_bytes)
        with open(scratch, "wb") as f:
            for _ in range(-(-size_bytes // block_bytes)):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        buffer = mmap.mmap(-1, block_bytes)  # page-aligned, as O_DIRECT requires
        try:
            fd, method = os.open(scratch, os.O_RDONLY | os.O_DIRECT), "python O_DIRECT"
        except OSError:
            fd, method = os.open(scratch, os.O_RDONLY), "python buffered (no O_DIRECT here)"
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total, start = 0, time.perf_counter()
            while (got := os.readv(fd, [buffer])) > 0:
                total += got
            seconds = time.perf_counter() - start
        finally:
            os.close(fd)
            buffer.close()
        return {"method": method, "bytes": total, "gb_per_s": total / seconds / 1e9}
    finally:
        scratch.unlink(missing_ok=True)
