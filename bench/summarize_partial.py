"""Tables, validity and the report page for the cells a run has finished, when the rest never ran.

A device lease can end before every cell of a config is measured. This applies the pipeline's own
pure steps (telemetry summaries, validity, Table 1, the report) to the finished cells of a results
tree brought back from that machine, leaving the tree's measured files as they are.

    python bench/summarize_partial.py WORKDIR [--tiers ram ...]

It writes results/table1.*, validity.csv, kv_bytes.* (cells with pool digests), tier_compare.*
(shared cells whose tier has a measured ceiling) and the report.

The config is the one the run resolved and recorded in its cells' manifests, not a config file
that may have changed since.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path

import pandas as pd
import yaml
from snakemake.utils import validate

from kvpool import steps
from kvpool.cells import cells
from kvpool.plan import plan_gpus

REPO = Path(__file__).resolve().parents[1]


def fleet_gpus_only(cell_dir: Path, phase: str, scratch: Path) -> dict:
    """The phase's meta and power files, limited to the fleet's GPUs.

    Samplers before the ``gpus`` meta key read every GPU of the host; on a host larger than the
    fleet, the idle GPUs' watts and joules are not the cell's. Filtered copies go to ``scratch``;
    the measured files stay as they are.
    """
    meta_path, power_path = cell_dir / f"{phase}.json", cell_dir / "telemetry" / f"{phase}-power.csv"
    meta = json.loads(meta_path.read_text())
    if "gpus" in meta["telemetry"] or meta["telemetry"].get("gpu_energy_j") is None:
        return {"meta": meta_path, "power": power_path}
    plan = yaml.safe_load((cell_dir / "plan.yaml").read_text())
    gpus = plan_gpus(plan)
    meta["telemetry"]["gpus"] = gpus
    meta["telemetry"]["gpu_energy_j"] = [meta["telemetry"]["gpu_energy_j"][i] for i in gpus]
    power = pd.read_csv(power_path)
    gpu_rows = power["source"].str.startswith("gpu")
    power = power[~gpu_rows | power["source"].isin([f"gpu{i}" for i in gpus])]
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / f"{phase}.json").write_text(json.dumps(meta))
    power.to_csv(scratch / f"{phase}-power.csv", index=False)
    print(f"{cell_dir.relative_to(cell_dir.parents[3])} {phase}: power limited to the fleet's GPU(s) {gpus}")
    return {"meta": scratch / f"{phase}.json", "power": scratch / f"{phase}-power.csv"}


def _existing(path: Path) -> Path | None:
    """A file a newer run writes, or None for records of runs before it."""
    return path if path.exists() else None


def run_config(workdir: Path) -> dict:
    """The resolved config every cell of the run recorded in its ``manifest.json``."""
    recorded = {json.dumps(json.loads(path.read_text())["config"]): path
                for path in sorted((workdir / "results" / "cells").rglob("manifest.json"))}
    if len(recorded) != 1:
        raise SystemExit(f"expected one config across the cells' manifests under {workdir}, found {len(recorded)}: "
                         + ", ".join(str(path) for path in recorded.values()))
    return json.loads(next(iter(recorded)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path, help="the run's working directory (holds results/)")
    parser.add_argument("--tiers", nargs="+", help="only these tiers (the ones that were measured)")
    args = parser.parse_args()
    config = run_config(args.workdir)
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    if args.tiers:
        config = copy.deepcopy(config)
        config["tiers"] = {name: config["tiers"][name] for name in args.tiers}
    root = args.workdir
    finished = [cell for cell in cells(config) if (root / "results" / "cells" / cell.name / "reuse.json").exists()]
    if not finished:
        raise SystemExit(f"no finished cell under {root}/results/cells")
    folder = {cell: root / "results" / "cells" / cell.name for cell in finished}
    scratch = Path(tempfile.mkdtemp(prefix="kvpool-partial-"))
    for cell, path in folder.items():
        steps.run_telemetry(
            {phase: {**fleet_gpus_only(path, phase, scratch / cell.name.replace("/", "_")),
                     "drive": path / "telemetry" / f"{phase}-drive.csv", "records": path / f"{phase}.csv"}
             for phase in ("populate", "reuse")},
            path / "telemetry" / "drive.csv", path / "telemetry" / "power.csv", path / "telemetry" / "summary.json")
        steps.run_validity(config, cell, populate_csv=path / "populate.csv", populate_json=path / "populate.json",
                           reuse_csv=path / "reuse.csv", reuse_json=path / "reuse.json",
                           reference_csv=root / "results" / "reference" / "outputs.csv",
                           populate_digests=_existing(path / "populate-digests.csv"),
                           reuse_digests=_existing(path / "pool-digests.csv"), out=path / "validity.json")
    results = root / "results"
    steps.run_summary(config, finished, [folder[c] / "reuse.csv" for c in finished],
                      [folder[c] / "reuse.json" for c in finished], [folder[c] / "validity.json" for c in finished],
                      [folder[c] / "telemetry" / "summary.json" for c in finished],
                      cells_csv=results / "cell_table.csv", csv_out=results / "table1.csv",
                      md_out=results / "table1.md")
    steps.run_validity_table([folder[c] / "validity.json" for c in finished], results / "validity.csv")
    digested = [c for c in finished if (folder[c] / "pool-digests.csv").exists()]
    if digested:
        steps.run_kv_bytes(config, digested, [folder[c] / "pool-digests.csv" for c in digested],
                           results / "kv_bytes.csv", results / "kv_bytes.md")
    ceiling = {tier: results / "tiers" / tier / "ceiling.json" for tier in config["tiers"]}
    compared = [c for c in finished if c.arm == "shared" and ceiling[c.tier].exists()]
    if compared:
        steps.run_tier_compare(config, compared, [folder[c] / "telemetry" / "summary.json" for c in compared],
                               [folder[c] / "reuse.csv" for c in compared],
                               [folder[c] / "telemetry" / "drive.csv" for c in compared],
                               sorted({str(ceiling[c.tier]) for c in compared}), tiers_csv=results / "tier_table.csv",
                               csv_out=results / "tier_compare.csv", md_out=results / "tier_compare.md")
    steps.build_report(config, finished, str(root), cell_table=results / "cell_table.csv",
                       tier_table=results / "tier_table.csv" if compared else None,
                       kv_bytes=results / "kv_bytes.csv" if digested else None,
                       out_html=results / "report.html", figures_dir=results / "report" / "figures",
                       tables_dir=results / "report" / "tables")
    print(f"{len(finished)} cell(s): {results / 'table1.md'}, {results / 'validity.csv'}, {results / 'report.html'}")


if __name__ == "__main__":
    main()
