"""Cost of telemetry sampling: CPU time the sampler thread uses, as a share of one core.

    python bench/sampler_overhead.py [SECONDS] [HZ]     # defaults: 30 s at 5 Hz

Samples the disks behind the current directory and two live processes (this one and its parent),
while the main thread sleeps, so the process's CPU time is the sampler's.
"""

import os
import resource
import sys
import time
from pathlib import Path

from kvpool.measure.drive import block_devices
from kvpool.measure.telemetry import Sampler


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(seconds: float, hz: float) -> None:
    disks = block_devices(Path.cwd())["disks"]
    pids = {0: os.getpid(), 1: os.getppid()}
    sampler = Sampler("bench", "idle", disks, hz=hz, pids=lambda: pids)  # NVML setup is not sampling cost
    before_cpu, before_wall = cpu_seconds(), time.perf_counter()
    with sampler:
        time.sleep(seconds)
    used, wall = cpu_seconds() - before_cpu, time.perf_counter() - before_wall
    drive, power = sampler.frames()
    ticks = power["t_s"].nunique()
    print(f"disks {disks}, {hz:g} Hz for {wall:.1f} s: {ticks} ticks, {len(drive)} drive rows, {len(power)} power rows")
    print(f"sampler CPU {used:.3f} s = {100 * used / wall:.2f}% of one core ({1000 * used / ticks:.2f} ms per tick)")


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 30.0, float(sys.argv[2]) if len(sys.argv) > 2 else 5.0)
