"""The host-to-GPU link on a GPU machine where Snakemake is not installed (the lent H200's bare image): the
ceiling rule's step for one tier, writing its ceiling.json as the rule does, then kvpool's own sampler
around sustained pinned copies, to see that the GPU state it records (clocks, PCIe byte counters,
clock-event reasons) shows the traffic the copies make.

    PYTHONPATH=src python3 bench/gpu_link.py --config resolved.yaml --tier ram --out OUT

``resolved.yaml`` is a config with ``extends`` merged and its schema's defaults filled, written where
Snakemake is installed: ``kvpool.config.load`` then ``snakemake.utils.validate``.
"""

import argparse
import json
import time
from pathlib import Path

import torch
import yaml

from kvpool.measure.telemetry import Sampler, summarize_power
from kvpool.settings import step_settings
from kvpool.studies.study_a import run_ceiling

COPY_BYTES = 1 << 30


def sampled_copies(seconds: float, gpu: int = 0) -> tuple[dict, object, int]:
    """Pinned 1 GiB copies into ``gpu`` for ``seconds``, sampled at 10 Hz: the sampler's meta, its GPU rows
    and the number of copies."""
    source = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True).fill_(1)
    target = torch.empty(COPY_BYTES, dtype=torch.uint8, device=f"cuda:{gpu}")
    copies = 0
    with Sampler("link", "copies", [], hz=10, gpus=[gpu]) as sampler:
        ends = time.monotonic() + seconds
        while time.monotonic() < ends:
            for _ in range(8):
                target.copy_(source, non_blocking=True)
            torch.cuda.synchronize(gpu)
            copies += 8
    return sampler.meta, sampler.frames()[1], copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--tier", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    config = yaml.safe_load(args.config.read_text())
    ceiling = args.out / "results" / "tiers" / args.tier / "ceiling.json"
    ceiling.parent.mkdir(parents=True, exist_ok=True)
    run_ceiling(step_settings(run_ceiling, config), args.tier, str(ceiling))
    found = json.loads(ceiling.read_text())["link"]
    print(f"link ceiling: {found.get('gb_per_s')} GB/s ({found['measured']})")
    for copy in found["copies"]:
        print(f"  gpu {copy.get('gpu')} {copy['memory']:8s} {copy['bytes'] / 2**20:8.0f} MiB: "
              f"{copy['gb_per_s']:6.1f} GB/s (min {copy['min_gb_per_s']:.1f}, max {copy['max_gb_per_s']:.1f}, "
              f"n={copy['n']})")
    meta, power, copies = sampled_copies(args.seconds)
    power.to_csv(args.out / "copies-power.csv", index=False)
    summary = summarize_power(power, meta, requests=copies)
    moved = copies * COPY_BYTES / meta["duration_s"] / 1e9
    (args.out / "copies.json").write_text(json.dumps(
        {"copies": copies, "copy_bytes": COPY_BYTES, "duration_s": meta["duration_s"], "copied_gb_per_s": moved,
         "summary": summary}, indent=2))
    print(f"sampled copies: {moved:.1f} GB/s copied; the sampler's GPU state: {json.dumps(summary.get('gpu_state'))}")


if __name__ == "__main__":
    main()
