import pytest
import yaml
from snakemake.utils import validate
from support import REPO

from kvpool.config import problems

SCHEMA = str(REPO / "workflow" / "schemas" / "config.schema.yaml")


def test_schema_fills_defaults():
    data = {"replicas": 2}
    validate(data, SCHEMA)
    assert data["engine"]["host"] == "127.0.0.1"
    assert data["arms"] == ["shared", "isolated"]
    assert data["workload"]["doc_tokens"] == 6000


def test_default_config_has_no_problems(config, tmp_path, free_disk):
    free_disk(10**12)  # on a machine with the room its pools need; a full drive is refused (below)
    assert problems(config, tmp_path) == []


def test_problems_name_the_key_at_fault(config, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    config["engine"]["ports"] = [18100]
    config["tiers"] = {"disk": str(tmp_path / "missing-parent-is-fine" / "pools"), "nvme": str(locked / "pools")}
    config["workload"]["doc_tokens"] = 2000      # 1792 of 2000 loadable with chunk 256: < 90%
    config["engine"]["max_model_len"] = 1024
    found = "\n".join(problems(config, tmp_path))
    assert "engine.ports lists 1 ports for 2 replicas" in found
    assert "min_hit_fraction" in found and "1792 of 2000" in found
    assert "engine.max_model_len is 1024" in found
    assert "missing-parent-is-fine" not in found
    import os
    if os.geteuid() != 0:  # root may write anywhere
        assert "tiers.nvme" in found


def test_pool_size_follows_the_model_and_dtype(config):
    from kvpool.config import pool_bytes_per_cell

    # 8 documents x (6000 + 200 follow-up tokens) x (2 x 4 layers x 1 KV head x 128 x 4 bytes of float32)
    assert pool_bytes_per_cell(config, "shared") == 8 * 6200 * 4096
    # the isolated serving replica stores the whole prompt again in its own pool
    assert pool_bytes_per_cell(config, "isolated") == 8 * 12200 * 4096
    config["engine"]["dtype"] = "bfloat16"
    assert pool_bytes_per_cell(config, "shared") == 8 * 6200 * 2048
    config["engine"]["model"] = "/models/real"
    assert pool_bytes_per_cell(config, "isolated") is None


def test_a_tier_too_small_for_its_pools_is_named(config, tmp_path, free_disk):
    free_disk(450_000_000)
    config["tiers"] = {"disk": str(tmp_path / "pools")}
    config["drive_ceiling_bytes"] = 1 << 20
    found = "\n".join(problems(config, tmp_path))
    # the shared (203 MB) and isolated (400 MB) pools do not fit in 450 MB together; one at a time they do
    assert "tiers.disk" in found and "needs 0.60 GB" in found and "keep_pools: false" in found
    config["keep_pools"] = False
    assert problems(config, tmp_path) == []
    free_disk(300_000_000)
    found = "\n".join(problems(config, tmp_path))  # the isolated pool alone does not
    assert "needs 0.40 GB" in found and "the largest pool" in found


def test_a_router_units_pool_counts_beside_the_largest_cell_pool(config, tmp_path, free_disk):
    free_disk(900_000_000)
    config.update(tiers={"disk": str(tmp_path / "pools")}, drive_ceiling_bytes=1 << 20, keep_pools=False)
    assert problems(config, tmp_path) == []
    # a router unit's pool may hold every document twice over the isolated arm's: 400 MB + 800 MB
    config["routers"]["names"] = ["cross", "prefix-affinity"]
    found = "\n".join(problems(config, tmp_path))
    assert "needs 1.20 GB" in found and "the largest pool and a router unit's" in found


def test_pools_already_in_the_tier_count_as_available(config, tmp_path, free_disk):
    free_disk(100_000_000)
    config["tiers"] = {"disk": str(tmp_path / "pools")}
    config["drive_ceiling_bytes"] = 1 << 20
    assert problems(config, tmp_path) != []
    from kvpool.cells import run_pools

    old = run_pools(config, "disk", tmp_path) / "some-cell"
    old.mkdir(parents=True)
    with open(old / "chunk", "wb") as chunk:  # sparse: its size is what counts
        chunk.truncate(600_000_000)
    assert problems(config, tmp_path) == []


def test_a_run_that_cannot_fit_stops_before_any_job(tmp_path):
    """Paths and space are checked on the machine that runs the jobs, before the first one."""
    import subprocess
    import sys

    overlay = yaml.safe_load((REPO / "tests" / "configs" / "e2e.yaml").read_text())
    overlay["workload"]["documents"] = 10_000_000  # ~84 TB of KV in float32
    overlay["random_model"] = {"vocab_words": 10_000_000}  # a first token of its own per document
    config_file = tmp_path / "huge.yaml"
    config_file.write_text(yaml.safe_dump(overlay))
    command = [sys.executable, "-m", "snakemake", "--cores", "1", "-s", str(REPO / "Snakefile"),
               "--directory", str(tmp_path), "--configfile", str(config_file)]
    dry = subprocess.run(command + ["-n"], capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr[-2000:]  # a plan for another machine is fine
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "tiers.disk" in run.stderr and "GB available but needs" in run.stderr
    assert not (tmp_path / "resources").exists() and not (tmp_path / "results").exists()


def test_localhost_and_ipv4_addresses_are_fine_hosts_and_ipv6_is_refused_by_name(config, tmp_path):
    for host in ("localhost", "127.0.0.1", "127.0.0.2"):
        config["engine"]["host"] = host
        assert not [p for p in problems(config, tmp_path) if "engine.host" in p]
    for host in ("0.0.0.0", "192.168.1.7"):  # beyond loopback: an explicit opt-in, engine.allow_remote
        config["engine"].update(host=host, allow_remote=False)
        assert [p for p in problems(config, tmp_path) if f"engine.host '{host}' listens beyond this machine" in p
                and "engine.allow_remote: true" in p]
        config["engine"]["allow_remote"] = True
        assert not [p for p in problems(config, tmp_path) if "engine.host" in p]
    config["engine"]["host"] = "::1"  # not "no 2 free ports": kvpool's port checks and URLs are IPv4
    assert [p for p in problems(config, tmp_path) if "engine.host '::1' is an IPv6 address" in p]


def test_the_free_space_check_reads_a_real_models_kv_size(config, tmp_path):
    """A local model's config.json gives its KV bytes per token, so a tier too small for its pools is refused."""
    import json

    from kvpool.config import pool_bytes_per_cell

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32,
                                                   "num_key_value_heads": 8, "hidden_size": 4096,
                                                   "torch_dtype": "bfloat16"}))
    config["engine"].update(model=str(model), dtype="auto")
    config["tiers"] = {"disk": str(tmp_path / "pools")}
    workload = config["workload"]
    # 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB per token
    assert pool_bytes_per_cell(config, "shared") == workload["documents"] * (workload["doc_tokens"] + 200) * 131072
    workload["documents"] = 10**7
    assert any(p.startswith("tiers.disk:") and "GB available but needs" in p for p in problems(config, tmp_path))


def test_a_configfile_replaces_the_default_and_config_values_layer_on_it(tmp_path):
    """The README's rule, from the repository root where config/config.yaml exists: --configfile
    replaces it (a standalone file's matrix, or an overlay's over the base it names), --config key=value
    layers on it."""
    import re
    import subprocess
    import sys

    def populates(*args):  # the cells planned: each populates (and reuses) in one job on one fleet
        out = subprocess.run([sys.executable, "-m", "snakemake", "-n", *args], cwd=REPO, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return int(re.search(r"^cell\s+(\d+)$", out.stdout, re.M).group(1))

    standalone = yaml.safe_load((REPO / "tests" / "configs" / "e2e.yaml").read_text())
    standalone["arms"] = ["shared"]
    (tmp_path / "one-arm.yaml").write_text(yaml.safe_dump(standalone))
    assert populates() == 2                                               # 2 arms x the disk tier
    assert populates("--configfile", str(tmp_path / "one-arm.yaml")) == 1  # its one arm, not the default's two
    assert populates("--configfile", "config/tiers.yaml") == 4            # the default, and the ram tier
    assert populates("--config", "arms=[shared]") == 1                    # the default, one arm


def test_an_overlay_after_another_configfile_is_refused_naming_both(tmp_path):
    """Snakemake merges --configfile files before extends is read: config/config.yaml before an overlay of
    config/capacity.yaml would make the Redis capacity run the default's pool of files on both tiers."""
    import pytest

    from kvpool.config import resolve_extends

    overlay = tmp_path / "more-capacity.yaml"
    overlay.write_text("extends: config/capacity.yaml\ncapacity: {fractions: [0.25]}\n")
    default = REPO / "config" / "config.yaml"
    merged = {**yaml.safe_load(default.read_text()), **yaml.safe_load(overlay.read_text())}
    refused = (rf"extends: {overlay} names its base config/capacity.yaml, but --configfile gives {default} before "
               r"it, whose keys \(arms, backends, .*\) would replace")
    with pytest.raises(ValueError, match=refused):
        resolve_extends(merged, REPO, [default, overlay])
    alone = yaml.safe_load(overlay.read_text())
    resolve_extends(alone, REPO, [overlay])  # alone (or first), the overlay is its base and its own keys
    assert alone["backends"] == ["lmcache-redis"] and alone["capacity"]["fractions"] == [0.25]


def test_replicas_the_machines_memory_cannot_hold_are_refused_at_start_with_the_estimate(config, tmp_path,
                                                                                           free_disk, monkeypatch):
    from types import SimpleNamespace

    import psutil

    free_disk(10**12)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=20 * 10**9, total=64 * 10**9))
    config["replicas"] = 8  # the default's 1 GiB KV cache, 0.5 GiB LMCache buffer and the process: 3.4 GB each
    (refused,) = [p for p in problems(config, tmp_path) if p.startswith("replicas 8")]
    assert "at least 3.4 GB" in refused and "8 of them 27.3 GB" in refused and "20.0 GB available" in refused
    assert not [p for p in problems(config, tmp_path, check_paths=False) if p.startswith("replicas")]
    config["replicas"] = 4
    assert not [p for p in problems(config, tmp_path) if p.startswith("replicas")]


def test_a_dry_run_warns_of_what_would_stop_the_run_on_this_machine(tmp_path):
    """A dry run may plan for another machine, so cores this one lacks do not refuse it; it says so."""
    import subprocess
    import sys

    (tmp_path / "cores.yaml").write_text("engine: {cores: [0, 4095]}\n")
    out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--directory", str(tmp_path), "-s",
                          str(REPO / "Snakefile"), "--configfile", str(REPO / "config" / "config.yaml"),
                          str(tmp_path / "cores.yaml")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("on this machine the run would stop before its first job: engine.cores lists cores [4095] that this "
            "process may not run on") in out.stderr


@pytest.mark.parametrize("path", sorted((REPO / "config").glob("*.yaml")), ids=lambda path: path.name)
def test_every_shipped_config_passes_the_checks_that_need_no_machine(path, tmp_path):
    """A shipped config refused on the machine it was written for costs a GPU start: each resolves, validates and
    passes every check that needs no tier folder or model directory (an L1 sized for a hybrid's pool bytes, Study B's
    blocks against the L1, the follow-ups' cold reloads)."""
    from kvpool.config import load, validated

    found = load(path, REPO)
    validated(found, REPO)
    assert problems(found, tmp_path, check_paths=False) == []
