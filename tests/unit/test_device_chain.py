"""bench/device_chain.sh carries Triton's cache from one lent machine to the next: `start` unpacks a carried cache
before the first config, and `wait`, once the chain is done, packs the machine's cache for the trip back."""

import shutil
import subprocess
import tarfile

from support import REPO

SCRIPT = REPO / "bench" / "device_chain.sh"


def chain(*args, tree, home, root, out):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "DEVICE_CHAIN_ROOT": str(root), "OUT": str(out)}
    return subprocess.run(["bash", "bench/device_chain.sh", *map(str, args)], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=60)


def test_a_carried_triton_cache_is_unpacked_at_start_and_the_machines_cache_packed_when_the_chain_is_done(
        tmp_path):
    tree, home, root, out = (tmp_path / name for name in ("tree", "home", "root", "out"))
    (tree / "bench").mkdir(parents=True)
    shutil.copy(SCRIPT, tree / "bench")
    kernel = tmp_path / "cache" / "abc123" / "kernel.cubin"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"\x7fELF kernel")
    (tree / ".gpu-bundle").mkdir()
    with tarfile.open(tree / ".gpu-bundle" / "triton-cache.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "cache", arcname="cache")
    out.mkdir()

    started = chain("start", 0, 0, tree=tree, home=home, root=root, out=out)  # no config: the chain ends at once
    assert started.returncode == 0, started.stderr
    assert "Triton's cache from an earlier machine, 1 files" in started.stdout
    assert (home / ".triton" / "cache" / "abc123" / "kernel.cubin").read_bytes() == b"\x7fELF kernel"
    assert not (root / "repo" / ".gpu-bundle").exists()  # the bundle is not copied with the tree

    (home / ".triton" / "cache" / "def456").mkdir()  # what this machine's replicas compiled
    (home / ".triton" / "cache" / "def456" / "kernel.json").write_text("{}")
    waited = chain("wait", 30, tree=tree, home=home, root=root, out=out)
    assert waited.returncode == 0, waited.stderr
    assert "device_chain: done" in waited.stdout and "Triton's cache packed" in waited.stdout
    with tarfile.open(out / "triton-cache.tar.gz") as tar:
        assert {"cache/abc123/kernel.cubin", "cache/def456/kernel.json"} <= set(tar.getnames())


def test_a_chain_still_running_brings_back_no_cache(tmp_path):
    home, root, out = tmp_path / "home", tmp_path / "root", tmp_path / "out"
    (home / ".triton" / "cache").mkdir(parents=True)
    (root / "keep").mkdir(parents=True)
    (root / "keep" / "chain.log").write_text("device_chain: config/x.yaml for 100 s from 00:00:00\n")
    out.mkdir()
    waited = chain("wait", 1, tree=REPO, home=home, root=root, out=out)
    assert waited.returncode == 0 and "Triton's cache" not in waited.stdout
    assert not (out / "triton-cache.tar.gz").exists()


def test_a_damaged_carried_cache_is_named_and_leaves_nothing_in_tritons_folder(tmp_path):
    tree, home, root, out = (tmp_path / name for name in ("tree", "home", "root", "out"))
    (tree / "bench").mkdir(parents=True)
    shutil.copy(SCRIPT, tree / "bench")
    (tree / ".gpu-bundle").mkdir()
    whole = tmp_path / "whole.tar.gz"
    kernel = tmp_path / "cache" / "abc123" / "kernel.cubin"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(bytes(range(256)) * 4096)
    with tarfile.open(whole, "w:gz") as tar:
        tar.add(tmp_path / "cache", arcname="cache")
    (tree / ".gpu-bundle" / "triton-cache.tar.gz").write_bytes(whole.read_bytes()[:2000])  # cut short on its way
    started = chain("start", 0, 0, tree=tree, home=home, root=root, out=out)
    assert started.returncode == 0
    assert "is not a Triton cache this script packed; kernels compile afresh" in started.stderr
    assert not (home / ".triton").exists()
