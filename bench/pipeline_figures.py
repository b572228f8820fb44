"""Print the speed figures of a finished run: per-rule wall time (Snakemake `benchmark:` files),
the whole run's span, and the shared arm's cross-replica TTFT p50 against the isolated arm's.

    python bench/pipeline_figures.py [WORKDIR]      # default: the current directory
"""

import sys
from pathlib import Path

import pandas as pd


def rule_timings(workdir: Path) -> pd.DataFrame:
    rows = []
    for tsv in sorted(workdir.glob("benchmarks/*.tsv")) + sorted(workdir.glob("results/cells/**/benchmarks/*.tsv")):
        cell = tsv.parent.parent.relative_to(workdir / "results" / "cells") if "cells" in tsv.parts else "-"
        seconds = pd.read_csv(tsv, sep="\t")["s"].iloc[-1]
        rows.append({"rule": tsv.stem, "cell": str(cell), "wall_s": round(float(seconds), 1)})
    return pd.DataFrame(rows)


def main(workdir: Path) -> None:
    timings = rule_timings(workdir)
    print(timings.to_string(index=False))
    print(f"\ntimed rules in total: {timings['wall_s'].sum():.0f} s")
    table = pd.read_csv(workdir / "results" / "table1.csv")
    p50 = table[table["metric"] == "ttft_p50_s"]
    for row in p50.itertuples():
        print(f"{row.backend} chunk {row.chunk} tier {row.tier}: TTFT p50 isolated {row.isolated:.3f} s, "
              f"shared {row.shared:.3f} s, ratio {row.ratio:.1f}x")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve())
