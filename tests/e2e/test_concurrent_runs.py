"""Two runs on one machine at once, in two working directories on one tier: both finish (issue 34's probe
saw both die on ports 18100/18101, and one ceiling crash on the other's scratch file)."""

import json
import re
import subprocess

import pandas as pd
import pytest
import yaml
from support import CONFIGS
from support.e2e import CELL, copy_prerequisites, replicas_running_in, snakemake_argv

# Outside the per-commit lane (docs/testing.md): `make test-full` runs it.
pytestmark = pytest.mark.full

SHARED = CELL.format(backend="lmcache-fs", arm="shared")
CEILING = "results/tiers/disk/ceiling.json"


def test_two_runs_started_together_on_one_tier_both_finish(tmp_path, prerequisites):
    config = yaml.safe_load((CONFIGS / "e2e.yaml").read_text())
    config["tiers"] = {"disk": str(tmp_path / "tier")}  # one tier path for both runs, as on a shared drive
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    runs, procs = [tmp_path / "a", tmp_path / "b"], []
    for workdir in runs:
        copy_prerequisites(prerequisites, workdir, parts=("resources", "results/workload"))
        argv = snakemake_argv(workdir, f"{SHARED}/populate.csv", tmp_path / "config.yaml")
        argv.insert(4, CEILING)  # a second target, before --configfile takes the rest
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [proc.communicate(timeout=1800)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for workdir, proc, output in zip(runs, procs, outputs, strict=True):
        assert proc.returncode == 0, f"{workdir.name}:\n{output[-6000:]}"
        populated = pd.read_csv(workdir / SHARED / "populate.csv")
        assert len(populated) == config["workload"]["documents"] and populated["error"].isna().all()
        ceiling = json.loads((workdir / CEILING).read_text())
        # a ceiling measured beside the other run's names that run's scratch file, never its own
        assert ceiling["gb_per_s"] > 0 and all(f"/kvpool-pools/{workdir.name}-" not in path
                                             for path in ceiling["concurrent_ceilings"])
        assert replicas_running_in(workdir) == []
    # each run's fleet ran on ports of its own, and each pool in a folder of its own on the one tier
    ports = [{int(port) for log in workdir.glob("logs/**/replica-*.log")
              for port in re.findall(r"Starting vLLM server on http://[\d.]+:(\d+)", log.read_text())}
             for workdir in runs]
    assert len(ports[0]) == len(ports[1]) == 2 and not ports[0] & ports[1], ports
    pools = sorted(path.parent.name for path in (tmp_path / "tier" / "kvpool-pools").glob("*/backend~lmcache-fs"))
    assert len(pools) == 2 and pools[0] != pools[1]
