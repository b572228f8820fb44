import os
import time

import psutil
import pytest

from kvpool.engine.pool_files import resident_bytes
from kvpool.measure.drive import block_devices, iostat
from kvpool.measure.telemetry import Sampler, rapl_delta_j


def test_sampler_attributes_a_real_read_to_the_device(tmp_path):
    disks = block_devices(tmp_path)["disks"]
    if not disks:
        pytest.skip(f"{tmp_path} is not on a block device")
    path = tmp_path / "blob"
    size = 64 * 1024 * 1024
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    assert resident_bytes(path) == 0
    before = psutil.Process().io_counters().read_bytes
    with Sampler("test", "read", disks, hz=20) as sampler:
        time.sleep(0.2)
        with open(path, "rb") as f:
            while f.read(4 * 1024 * 1024):
                pass
        time.sleep(0.2)
    own = psutil.Process().io_counters().read_bytes - before
    drive, _ = sampler.frames()
    read = iostat(drive)["r_bytes"].sum()
    # this process fetched the file from storage once (readahead never reads past its end); the drive's
    # counters saw at least that, plus whatever other readers of the drive did meanwhile (the other
    # test workers import packages from it: 40 MB more in one run)
    assert own == pytest.approx(size, rel=0.10)
    assert read >= 0.95 * own
    assert set(drive["phase"]) == {"read"} and set(drive["cell"]) == {"test"}
    assert sampler.meta["started_at"] <= drive["t_s"].min() and drive["t_s"].max() <= sampler.meta["finished_at"]


def test_absent_sources_are_unavailable_not_zero(tmp_path):
    with Sampler("c", "p", [], hz=10, pids=lambda: {0: os.getpid()}) as sampler:
        time.sleep(0.3)
    _, power = sampler.frames()
    assert set(power["source"]) == {"replica0", "host"}
    assert (power.loc[power["source"] == "replica0", "rss_bytes"] > 0).all()
    if not sampler.nvml.available:
        assert sampler.meta["gpu_energy_j"] is None and sampler.meta["gpu_unavailable"]


def test_rapl_delta_handles_counter_wrap(tmp_path):
    domain = tmp_path / "intel-rapl:0"
    domain.mkdir()
    (domain / "max_energy_range_uj").write_text("1000000000\n")
    assert rapl_delta_j({"pkg": 990.0}, {"pkg": 5.0}, {"pkg": domain}) == pytest.approx(15.0)


class RecordedNvml:
    """pynvml's calls answered with readings recorded on an H200 (milliwatts, millijoules)."""

    POWER_MW = [412345, 118990]

    def __init__(self):
        # each GPU's total-energy counter at the phase's start, then at its end
        self.energy_mj = {0: iter([1_000_000, 8_600_000]), 1: iter([2_000_000, 2_260_000])}

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetPowerUsage(self, handle):
        return self.POWER_MW[handle]

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return next(self.energy_mj[handle])


def test_nvml_readings_become_watts_and_joules(monkeypatch):
    import sys

    from kvpool.measure.telemetry import summarize_power

    monkeypatch.setitem(sys.modules, "pynvml", RecordedNvml())
    with Sampler("c", "reuse", [], hz=20) as sampler:
        time.sleep(0.2)
    _, power = sampler.frames()
    gpus = power[power["source"].str.startswith("gpu")]
    assert set(gpus["source"]) == {"gpu0", "gpu1"}
    assert gpus.groupby("source")["power_w"].first().to_dict() == {"gpu0": 412.345, "gpu1": 118.99}
    assert sampler.meta["gpu_energy_j"] == [7600.0, 260.0]
    summary = summarize_power(power, sampler.meta, requests=4)
    # mean power is the energy counter over the window; the 20 Hz samples' mean is kept beside it
    assert summary["mean_power_w"] == pytest.approx(7860.0 / sampler.meta["duration_s"])
    assert summary["mean_power_source"] == "NVML energy counter over the window"
    assert summary["sampled_mean_power_w"] == pytest.approx(412.345 + 118.99)
    assert summary["gpu_energy_j"] == pytest.approx(7860.0)
    assert summary["energy_per_request_j"] == pytest.approx(1965.0)


class RecordedNvmlState(RecordedNvml):
    """The calls behind Nvml.state too, answered with an H200's readings during pinned host-to-GPU copies
    (docs/results/h200-link/copies-power.csv); GPU 1's memory clock is not reported."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2
    NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1

    class NVMLError(Exception):
        pass

    def nvmlDeviceGetClockInfo(self, handle, clock):
        if handle == 1 and clock == self.NVML_CLOCK_MEM:
            raise self.NVMLError("Not Supported")
        return 1980 if clock == self.NVML_CLOCK_SM else 3201

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return 0 if handle == 0 else 0x4  # GPU 1 held at its software power cap

    def nvmlDeviceGetPcieThroughput(self, handle, counter):
        return 59485612 if counter == self.NVML_PCIE_UTIL_RX_BYTES else 5171391  # KB/s


def _real_reason_names():
    import pynvml

    for name in dir(pynvml):
        if name.startswith("nvmlClocksEventReason"):  # the library's own names of the reason bits
            setattr(RecordedNvmlState, name, getattr(pynvml, name))


_real_reason_names()


def test_the_gpus_clocks_pcie_rates_and_throttle_reasons_are_sampled_beside_power(monkeypatch):
    """What explains an outlier (issue 35): each sample holds the clocks, the PCIe rates and the clock-event
    reasons; a value a GPU does not report is absent, and a library without these calls (RecordedNvml, an
    older nvidia-ml-py) samples power as before."""
    import sys

    from kvpool.measure.telemetry import summarize_power

    monkeypatch.setitem(sys.modules, "pynvml", RecordedNvmlState())
    with Sampler("c", "reuse", [], hz=20) as sampler:
        time.sleep(0.2)
    _, power = sampler.frames()
    state = summarize_power(power, sampler.meta, requests=1)["gpu_state"]
    assert state["gpu0"]["sm_clock_mhz"] == {"min": 1980.0, "p50": 1980.0, "max": 1980.0}
    assert state["gpu0"]["pcie_rx_gb_per_s"]["mean"] == pytest.approx(59.485612)
    assert state["gpu0"]["pcie_tx_gb_per_s"]["max"] == pytest.approx(5.171391)
    assert state["gpu0"]["clock_event_reasons"] == {}
    assert "mem_clock_mhz" not in state["gpu1"] and state["gpu1"]["clock_event_reasons"] == {"sw_power_cap": 1.0}
    monkeypatch.setitem(sys.modules, "pynvml", RecordedNvml())
    with Sampler("c", "reuse", [], hz=20) as sampler:
        time.sleep(0.1)
    _, power = sampler.frames()
    assert "sm_clock_mhz" not in power and "gpu_state" not in summarize_power(power, sampler.meta, requests=1)


def test_only_the_fleets_gpus_are_sampled(monkeypatch):
    """A cell on GPU 1 of a shared host: GPU 0's watts and joules are someone else's."""
    import sys

    from kvpool.measure.telemetry import Nvml, summarize_power

    monkeypatch.setitem(sys.modules, "pynvml", RecordedNvml())
    with Sampler("c", "reuse", [], hz=20, gpus=[1]) as sampler:
        time.sleep(0.2)
    _, power = sampler.frames()
    assert set(power["source"]) == {"gpu1", "host"} and sampler.meta["gpus"] == [1]
    summary = summarize_power(power, sampler.meta, requests=2)
    assert summary["sampled_mean_power_w"] == pytest.approx(118.99)
    assert summary["mean_power_w"] == pytest.approx(260.0 / sampler.meta["duration_s"])
    assert summary["gpu_energy_j"] == pytest.approx(260.0)
    absent = Nvml([5])
    assert not absent.available and "not present" in absent.reason


def test_mean_power_comes_from_the_energy_counter_where_samples_miss_the_peaks():
    """Samples a few times a second miss short peaks (on the H200 at 32 in flight they read 300 W where the
    counter gave 388 W): the window's mean is the counter's; without one, the samples' mean, named so."""
    import pandas as pd

    from kvpool.measure.telemetry import summarize_power

    samples = pd.DataFrame({"t_s": [0.0, 0.2, 0.4], "source": ["gpu0"] * 3, "power_w": [300.0] * 3})
    counted = summarize_power(samples, {"gpu_energy_j": [3880.0], "duration_s": 10.0}, requests=10)
    assert counted["mean_power_w"] == pytest.approx(388.0) and counted["sampled_mean_power_w"] == 300.0
    sampled = summarize_power(samples, {"gpu_energy_j": None, "duration_s": 10.0}, requests=10)
    assert sampled["mean_power_w"] == 300.0 and sampled["mean_power_source"] == "board-power samples"
    none = summarize_power(pd.DataFrame(), {"gpu_energy_j": None, "gpu_unavailable": "no NVML"}, requests=1)
    assert none["mean_power_w"] is None and none["gpu_unavailable"] == "no NVML"


def test_records_of_a_sampler_that_read_every_gpu_count_only_the_fleets():
    import pandas as pd

    from kvpool.measure.telemetry import fleet_gpus_only, summarize_power

    # a fleet on GPU 1 of a 4-GPU host, sampled by a sampler that read all four
    meta = {"gpu_energy_j": [50.0, 400.0, 60.0, 70.0], "host_energy_j": None}
    power = pd.DataFrame({"t_s": [0.0] * 4 + [0.2] * 4, "source": ["gpu0", "gpu1", "gpu2", "gpu3"] * 2,
                          "power_w": [60.0, 500.0, 70.0, 80.0, 62.0, 520.0, 71.0, 79.0]})
    meta_fleet, power_fleet = fleet_gpus_only(meta, power, [1])
    summary = summarize_power(power_fleet, meta_fleet, requests=4)
    assert summary["gpu_energy_j"] == 400.0 and summary["energy_per_request_j"] == 100.0
    assert summary["mean_power_w"] == 510.0
    # a record that names its GPUs is the fleet's already
    named = {**meta, "gpus": [0, 1, 2, 3]}
    assert fleet_gpus_only(named, power, [1]) == (named, power)


def test_the_hosts_cpu_is_sampled_and_a_busy_or_stolen_host_shows_in_the_window():
    """A replica whose engine steps are host-bound served slower on the H200 at the same GPU clocks and its own
    CPU share: the host's busy and stolen time say whether the machine around it was the cause."""
    import threading

    import pandas as pd

    from kvpool.measure.telemetry import host_state, summarize_power

    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    with Sampler("c", "p", [], hz=20) as sampler:
        spinner.start()
        time.sleep(0.6)
        stop.set()
        spinner.join()
    _, power = sampler.frames()
    host = power[power["source"] == "host"]
    assert len(host) >= 5 and host["host_busy_s"].is_monotonic_increasing and (host["host_steal_s"] >= 0).all()
    state = summarize_power(power, sampler.meta, requests=1)["host_cpu"]
    assert 0 < state["busy_share"] <= 1 and 0 <= state["steal_share"] < 1
    assert state["busy_cpus"] >= 0.5  # the spinning thread kept about one CPU busy
    # the arithmetic on known counters: 2 s over 4 CPUs, 3 CPU-seconds busy, 1 stolen, 4 idle
    rows = pd.DataFrame({"t_s": [0.0, 2.0], "host_busy_s": [10.0, 13.0], "host_idle_s": [50.0, 54.0],
                         "host_steal_s": [1.0, 2.0], "host_cpu_mhz": [2400.0, 1800.0]})
    assert host_state(rows) == {"busy_share": 3 / 8, "steal_share": 1 / 8, "busy_cpus": 1.5,
                                "cpu_mhz": {"min": 1800.0, "p50": 2100.0, "max": 2400.0}}
    assert host_state(rows.iloc[:1]) is None  # one sample spans no time
