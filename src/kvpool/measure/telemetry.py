"""What the drive, the GPUs and the host did during a phase, sampled alongside it.

A :class:`Sampler` runs a thread for the length of one phase: /proc/diskstats of the tier's disks,
NVML board power per GPU, and each replica's CPU time and resident memory, every row stamped with
wall-clock time (the same clock as ``started_at`` in the request records), phase and cell.
Energy counters (NVML total energy, RAPL) are read at the phase's start and end. A source that is
absent is recorded as unavailable, never as zero.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path

import pandas as pd
import psutil

from kvpool.measure.drive import read_diskstats

log = logging.getLogger(__name__)
RAPL_ROOT = Path("/sys/class/powercap")
FAMILY_REFRESH_S = 5.0  # vLLM's engine and worker processes appear at startup, before sampling begins


class Nvml:
    """NVML board power and total-energy counters of the GPUs ``indices`` (all GPUs when None);
    ``available`` is False without a GPU. Indices are NVML's (PCI bus order), which the replicas'
    CUDA_VISIBLE_DEVICES follows because plans set CUDA_DEVICE_ORDER=PCI_BUS_ID."""

    def __init__(self, indices: list[int] | None = None):
        self.handles, self.indices, self.reason = [], [], None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            count = pynvml.nvmlDeviceGetCount()
            self.indices = list(range(count)) if indices is None else sorted(indices)
            if missing := [i for i in self.indices if i >= count]:
                raise ValueError(f"GPU(s) {missing} not present: NVML sees {count}")
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in self.indices]
        except Exception as exc:  # the library raises its own NVMLError subclasses, or is absent
            self.reason = f"{type(exc).__name__}: {exc}"

    @property
    def available(self) -> bool:
        return bool(self.handles)

    def power_w(self) -> list[float]:
        return [self._nvml.nvmlDeviceGetPowerUsage(h) / 1000.0 for h in self.handles]

    def energy_j(self) -> list[float]:
        return [self._nvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0 for h in self.handles]

    def state(self) -> list[dict]:
        """Per GPU what explains an outlier beside its power: SM and memory clocks (MHz), the clock-event
        (throttle) reasons as NVML's bitmask, and PCIe receive and send rates (GB/s, NVML's throughput
        counter over its own 20 ms window; NVML's PCIe byte counters are 32 bits and wrap several times a
        second at the link's rate). A value the GPU or driver does not report is absent."""
        nvml, found = self._nvml, []
        error = getattr(nvml, "NVMLError", Exception)
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        reads = {
            "sm_clock_mhz": lambda h: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),
            "mem_clock_mhz": lambda h: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM),
            "clock_event_reasons": reasons,
            # KB/s: 1,000 bytes (H200, host-to-GPU copies of 55 GB/s by CUDA events read 59.5e6, protocol included)
            "pcie_rx_gb_per_s": lambda h: nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES) / 1e6,
            "pcie_tx_gb_per_s": lambda h: nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES) / 1e6,
        }
        for handle in self.handles:
            state = {}
            for key, read in reads.items():
                try:
                    state[key] = read(handle)
                except (error, AttributeError, TypeError):  # not reported here, or not in this nvidia-ml-py
                    continue
            found.append(state)
        return found

    def close(self) -> None:
        if self.handles:
            self._nvml.nvmlShutdown()


def rapl_domains(root: Path = RAPL_ROOT) -> dict[str, Path]:
    """Readable RAPL package domains: name -> folder holding energy_uj."""
    found = {}
    for folder in sorted(root.glob("intel-rapl:*")):
        energy = folder / "energy_uj"
        try:
            energy.read_text()
        except OSError:
            continue
        found[(folder / "name").read_text().strip() + "@" + folder.name] = folder
    return found


def rapl_energy_j(domains: dict[str, Path]) -> dict[str, float]:
    return {name: int((folder / "energy_uj").read_text()) / 1e6 for name, folder in domains.items()}


def rapl_delta_j(start: dict[str, float], end: dict[str, float], domains: dict[str, Path]) -> float:
    """Energy between two RAPL readings, summed over domains, with counter wrap-around handled."""
    total = 0.0
    for name, folder in domains.items():
        delta = end[name] - start[name]
        if delta < 0:
            delta += int((folder / "max_energy_range_uj").read_text()) / 1e6
        total += delta
    return total


class Sampler:
    """Samples one phase of one cell at ``hz`` on a thread of its own."""

    def __init__(self, cell: str, phase: str, disks: list[str], hz: float = 5.0, pids=lambda: {},
                 gpus: list[int] | None = None):
        self.cell, self.phase, self.disks, self.interval_s = cell, phase, set(disks), 1.0 / hz
        self.pids = pids  # callable: replica index -> pid, read at each tick
        self.drive_rows: list[dict] = []
        self.power_rows: list[dict] = []
        self.nvml = Nvml(gpus)  # only the fleet's GPUs: other GPUs of the host are not this cell's power
        self.rapl = rapl_domains()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"sampler-{phase}", daemon=True)
        self.meta: dict = {}
        self._families: dict[int, tuple[float, list[psutil.Process]]] = {}

    def __enter__(self) -> Sampler:
        self.meta = {"cell": self.cell, "phase": self.phase, "disks": sorted(self.disks), "hz": 1 / self.interval_s,
                     "gpus": self.nvml.indices,
                     "started_at": time.time(),
                     "gpu_energy_start_j": self.nvml.energy_j() if self.nvml.available else None,
                     "rapl_start_j": rapl_energy_j(self.rapl) if self.rapl else None}
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.meta["finished_at"] = time.time()
        self.meta["duration_s"] = self.meta["finished_at"] - self.meta["started_at"]
        if self.nvml.available:
            end = self.nvml.energy_j()
            self.meta["gpu_energy_j"] = [e - s for s, e in zip(self.meta.pop("gpu_energy_start_j"), end, strict=True)]
        else:
            self.meta.pop("gpu_energy_start_j")
            self.meta["gpu_energy_j"] = None
            self.meta["gpu_unavailable"] = self.nvml.reason
        if self.rapl:
            self.meta["host_energy_j"] = rapl_delta_j(self.meta.pop("rapl_start_j"), rapl_energy_j(self.rapl),
                                                      self.rapl)
        else:
            self.meta.pop("rapl_start_j")
            self.meta["host_energy_j"] = None
            self.meta["host_energy_unavailable"] = f"no readable RAPL domain under {RAPL_ROOT}"
        self.nvml.close()

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            self.sample()
            next_tick += self.interval_s
            self._stop.wait(max(0.0, next_tick - time.monotonic()))
        self.sample()  # the phase's last moment

    def sample(self) -> None:
        now = time.time()
        stamp = {"t_s": now, "phase": self.phase, "cell": self.cell}
        if self.disks:
            with open("/proc/diskstats") as f:
                stats = read_diskstats(f.read(), self.disks)
            self.drive_rows += [{**stamp, "device": device, **counters} for device, counters in stats.items()]
        if self.nvml.available:
            for gpu, watts, state in zip(self.nvml.indices, self.nvml.power_w(), self.nvml.state(), strict=True):
                self.power_rows.append({**stamp, "source": f"gpu{gpu}", "power_w": watts, **state})
        self.power_rows.append({**stamp, "source": "host", **host_cpu()})
        for replica, pid in self.pids().items():
            cpu_s, rss = 0.0, 0
            for proc in self._family(pid, now):
                try:
                    with proc.oneshot():
                        cpu_s += sum(proc.cpu_times()[:2])
                        rss += proc.memory_info().rss
                except psutil.NoSuchProcess:
                    continue
            if rss:
                self.power_rows.append({**stamp, "source": f"replica{replica}", "cpu_s": cpu_s, "rss_bytes": rss})

    def _family(self, pid: int, now: float) -> list[psutil.Process]:
        """A replica's process and its children; the child list is rescanned every few seconds only."""
        cached = self._families.get(pid)
        if cached is None or now - cached[0] > FAMILY_REFRESH_S:
            try:
                root = psutil.Process(pid)
                cached = (now, [root] + root.children(recursive=True))
            except psutil.NoSuchProcess:
                cached = (now, [])
            self._families[pid] = cached
        return cached[1]

    def frames(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        return pd.DataFrame(self.drive_rows), pd.DataFrame(self.power_rows)


def _stats(series: pd.Series) -> dict:
    series = series.dropna()
    if series.empty:
        return {"mean": None, "p50": None, "p95": None, "max": None}
    return {"mean": float(series.mean()), "p50": float(series.quantile(0.5)), "p95": float(series.quantile(0.95)),
            "max": float(series.max())}


def drive_per_tick(derived: pd.DataFrame) -> pd.DataFrame:
    """iostat rows of all a tier's disks added up per sampling tick (rates and queue depths add;
    utilisation is the busiest disk's)."""
    return derived.groupby("t_s").agg(r_mb_per_s=("r_mb_per_s", "sum"), w_mb_per_s=("w_mb_per_s", "sum"),
                                      aqu_sz=("aqu_sz", "sum"), util_pct=("util_pct", "max"))


def summarize_drive(derived: pd.DataFrame, duration_s: float) -> dict:
    """One phase's drive figures from iostat rows (all its disks together where rates add up)."""
    if derived.empty:
        return {"available": False}
    per_tick = drive_per_tick(derived)
    read_bytes = float(derived["r_bytes"].sum())
    read_ios = float(derived["r_ios"].sum())
    reading = derived[derived["r_per_s"] > 0]
    return {
        "available": True,
        "read_bytes": read_bytes,
        "write_bytes": float(derived["w_bytes"].sum()),
        "read_gb_per_s": read_bytes / duration_s / 1e9 if duration_s else None,
        "read_active_gb_per_s": float(per_tick.loc[per_tick["r_mb_per_s"] > 0, "r_mb_per_s"].mean() / 1000)
        if (per_tick["r_mb_per_s"] > 0).any() else None,
        "avg_read_kb": read_bytes / 1024 / read_ios if read_ios else None,
        "r_mb_per_s": _stats(per_tick["r_mb_per_s"]),
        "w_mb_per_s": _stats(per_tick["w_mb_per_s"]),
        "aqu_sz": _stats(per_tick["aqu_sz"]),
        "util_pct": _stats(per_tick["util_pct"]),
        "r_await_ms": _stats(reading["r_await_ms"]),
    }


def fleet_gpus_only(meta: dict, power: pd.DataFrame, gpus: list[int]) -> tuple[dict, pd.DataFrame]:
    """A phase's power meta and samples limited to the fleet's GPUs.

    Samplers before the ``gpus`` meta key read every GPU of the host; on a host larger than the fleet
    the idle GPUs' watts and joules are not the cell's. Newer records are returned as they are.
    """
    if "gpus" in meta or meta.get("gpu_energy_j") is None:
        return meta, power
    meta = {**meta, "gpus": gpus, "gpu_energy_j": [meta["gpu_energy_j"][i] for i in gpus]}
    if not power.empty:
        gpu_rows = power["source"].str.startswith("gpu")
        power = power[~gpu_rows | power["source"].isin([f"gpu{i}" for i in gpus])]
    return meta, power


def energy_mean_power(power: dict, duration_s: float | None) -> dict:
    """``power`` (a :func:`summarize_power` record) with its mean from the energy counter over the window of
    ``duration_s``: records written before the counter gave the mean kept the samples' mean instead, which
    a few samples a second put below the counter's (300 W against 388 W on the H200 at 32 in flight)."""
    if power.get("mean_power_source") or not power.get("gpu_energy_j") or not duration_s:
        return power
    return {**power, "sampled_mean_power_w": power.get("mean_power_w"),
            "mean_power_w": power["gpu_energy_j"] / duration_s,
            "mean_power_source": "NVML energy counter over the window"}


def phase_power(phase: dict) -> dict:
    """A phase summary's power, its mean from the energy counter over the phase (:func:`energy_mean_power`)."""
    return energy_mean_power(phase["power"], phase.get("duration_s"))


def clock_event_names(mask: int) -> list[str]:
    """NVML's clock-event (throttle) reason bits in ``mask`` by name (``sw_power_cap``, ``hw_thermal_slowdown``,
    ...), from the NVML library's own constants."""
    import pynvml

    bits = {getattr(pynvml, name): re.sub(r"(?<!^)(?=[A-Z])", "_", name.removeprefix("nvmlClocksEventReason")).lower()
            for name in dir(pynvml)
            if name.startswith("nvmlClocksEventReason") and name not in ("nvmlClocksEventReasonAll",
                                                                         "nvmlClocksEventReasonNone")}
    named = [name for bit, name in sorted(bits.items()) if mask & bit]
    rest = mask & ~sum(bits)
    return named + ([f"0x{rest:x}"] if rest else [])


def host_cpu() -> dict:
    """The whole host's CPU now, beside the replicas' own time: cumulative busy, idle and steal seconds over
    every CPU (steal: time a virtual machine's CPUs waited for the hypervisor) and the mean current clock
    (MHz; absent where the kernel does not report it, as in many virtual machines). A replica whose engine
    steps are host-bound serves slower on a busy or stolen host at the same GPU clocks."""
    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    steal = getattr(times, "steal", 0.0)
    guests = getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0)  # already counted in user time
    found = {"host_busy_s": sum(times) - idle - steal - guests, "host_idle_s": idle, "host_steal_s": steal}
    freq = psutil.cpu_freq()
    if freq is not None and freq.current:
        found["host_cpu_mhz"] = float(freq.current)
    return found


def host_state(host: pd.DataFrame) -> dict | None:
    """The host's CPU over a window (its ``host`` samples): the shares of its CPU time that were busy and
    stolen, the CPUs' busy count, and the clock (min, p50, max) where reported."""
    if host.empty or "host_busy_s" not in host or len(host) < 2:
        return None
    first, last = host.iloc[0], host.iloc[-1]
    spent = {key: float(last[key] - first[key]) for key in ("host_busy_s", "host_idle_s", "host_steal_s")}
    total = sum(spent.values())
    if total <= 0:
        return None
    state = {"busy_share": spent["host_busy_s"] / total, "steal_share": spent["host_steal_s"] / total,
             "busy_cpus": spent["host_busy_s"] / float(last["t_s"] - first["t_s"])}
    if "host_cpu_mhz" in host and host["host_cpu_mhz"].notna().any():
        mhz = host["host_cpu_mhz"].dropna()
        state["cpu_mhz"] = {"min": float(mhz.min()), "p50": float(mhz.median()), "max": float(mhz.max())}
    return state


def gpu_state(gpus: pd.DataFrame) -> dict:
    """Per GPU over a window (its board samples with :meth:`Nvml.state`'s columns): SM and memory clocks
    (min, p50, max), PCIe receive and send rates (mean, p95 and max of the samples), and each clock-event
    reason with the fraction of samples it was set in."""
    found = {}
    for source, rows in gpus.groupby("source"):
        state = {}
        for clock in ("sm_clock_mhz", "mem_clock_mhz"):
            if clock in rows and rows[clock].notna().any():
                values = rows[clock].dropna()
                state[clock] = {"min": float(values.min()), "p50": float(values.median()), "max": float(values.max())}
        for way in ("rx", "tx"):
            column = f"pcie_{way}_gb_per_s"
            if column in rows and rows[column].notna().any():
                values = rows[column].dropna()
                state[column] = {"mean": float(values.mean()), "p95": float(values.quantile(0.95)),
                                 "max": float(values.max())}
        if "clock_event_reasons" in rows and rows["clock_event_reasons"].notna().any():
            masks = rows["clock_event_reasons"].dropna().astype(int).value_counts()  # each mask named once
            shares: dict[str, float] = {}
            for mask, count in masks.items():
                for name in clock_event_names(int(mask)):
                    shares[name] = shares.get(name, 0.0) + count / masks.sum()
            state["clock_event_reasons"] = {name: float(share) for name, share in shares.items()}
        if state:
            found[source] = state
    return found


def summarize_power(power: pd.DataFrame, meta: dict, requests: int) -> dict:
    """Mean GPU power over the window, energy per request, host energy, the host's CPU (``host_cpu``), and
    each replica's CPU time and peak RSS. Mean power is the NVML energy counter's delta over the window's
    length, which integrates every moment; the board-power samples (a few per second, which miss short
    peaks) give the per-GPU means and ``sampled_mean_power_w`` beside it, and the mean only where no
    counter was read."""
    summary: dict = {"requests": requests}
    gpus = power[power["source"].str.startswith("gpu")] if not power.empty else power
    energy = sum(meta["gpu_energy_j"]) if meta.get("gpu_energy_j") else None
    sampled = float(gpus.groupby("t_s")["power_w"].sum().mean()) if not gpus.empty else None
    if not gpus.empty:
        summary["gpu_mean_power_w"] = {s: float(g["power_w"].mean()) for s, g in gpus.groupby("source")}
        if state := gpu_state(gpus):  # clocks, PCIe and throttle reasons, where the samples hold them
            summary["gpu_state"] = state
    summary["sampled_mean_power_w"] = sampled
    if energy is not None and meta.get("duration_s"):
        summary["mean_power_w"] = energy / meta["duration_s"]
        summary["mean_power_source"] = "NVML energy counter over the window"
    else:
        summary["mean_power_w"] = sampled
        summary["mean_power_source"] = "board-power samples" if sampled is not None else None
    if sampled is None and energy is None:
        summary["gpu_unavailable"] = meta.get("gpu_unavailable")
    summary["gpu_energy_j"] = energy
    summary["energy_per_request_j"] = energy / requests if energy is not None and requests else None
    summary["host_energy_j"] = meta.get("host_energy_j")
    if summary["host_energy_j"] is None:
        summary["host_energy_unavailable"] = meta.get("host_energy_unavailable")
    if not power.empty and (host := host_state(power[power["source"] == "host"])) is not None:
        summary["host_cpu"] = host
    replicas = power[power["source"].str.startswith("replica")] if not power.empty else power
    summary["replicas"] = {
        source: {"cpu_s": float(g["cpu_s"].iloc[-1] - g["cpu_s"].iloc[0]), "peak_rss_bytes": int(g["rss_bytes"].max())}
        for source, g in replicas.groupby("source")
    } if not replicas.empty else {}  # an external fleet's replicas are no processes of ours to sample
    return summary
