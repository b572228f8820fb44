"""A real one-node SLURM cluster for the tests: Debian's munge and SLURM daemons on this machine,
with their own key, socket, ports, state and logs under one folder, so nothing of the machine's own
configuration is read or changed. ``make test`` installs the packages (as root, where apt-get works).
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo", "unshare")


def missing_programs() -> list[str]:
    """The programs a cluster needs that this machine lacks (Debian: slurm-wlm, munge)."""
    return [name for name in DAEMONS if shutil.which(name) is None]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def slurm_conf(root: Path, socket_path: Path, node: str, cpus: int, memory_mb: int) -> str:
    """slurm.conf for one node on loopback: no accounting, no cgroups (a container has none to give),
    and finished jobs kept in squeue's view for an hour: the executor's squeue status needs them there
    until it has seen them end, and the test reads every job of its run (12 minutes on 2 cores)."""
    return "\n".join([
        "ClusterName=kvpool-test",
        f"SlurmctldHost={node}(127.0.0.1)",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={socket_path}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "ReturnToService=2",
        "MinJobAge=3600",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN",
        "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


def _wait_for_idle_node(env: dict, logs: list[Path], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = subprocess.run(["sinfo", "--noheader", "--format=%t"], env=env, capture_output=True, text=True)
        if state.stdout.strip() == "idle":
            return
        time.sleep(0.5)
    tails = "\n".join(f"{log}:\n{log.read_text()[-2000:] if log.exists() else '(none)'}" for log in logs)
    raise RuntimeError(f"the test cluster's node did not turn idle in {timeout_s:.0f} s\n{tails}")


@contextlib.contextmanager
def single_node_cluster(root: Path, memory_mb: int = 20_000):
    """Starts munged, slurmctld and slurmd for a one-node cluster (this machine) under ``root``;
    yields the environment whose ``SLURM_CONF`` points SLURM's commands at it. On exit every job of
    the cluster is cancelled and the daemons are stopped, whatever happened inside."""
    root.mkdir(parents=True, exist_ok=True)
    for folder in ("state", "spool"):
        (root / folder).mkdir(exist_ok=True)
    key = root / "munge.key"
    subprocess.run(["mungekey", "--create", f"--keyfile={key}", "--force"], check=True, capture_output=True)
    key.chmod(0o600)
    # munged wants every folder above its socket searchable by all; pytest's tmp folders are not
    sockets = Path(tempfile.mkdtemp(prefix="kvpool-munge-"))
    sockets.chmod(0o755)
    socket_path = sockets / "munge.socket"
    etc = root / "etc"
    etc.mkdir(exist_ok=True)
    conf = etc / "slurm.conf"
    conf.write_text(slurm_conf(root, socket_path, socket.gethostname(), os.cpu_count() or 1, memory_mb))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    # The executor's job step drops every SLURM_* variable before its nested srun, SLURM_CONF too, so
    # srun reads SLURM's default /etc/slurm. The daemons run in a mount namespace of their own where
    # that folder is this cluster's, and their jobs inherit it; the machine's /etc/slurm is untouched.
    in_namespace = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    'mount --bind "$0" /etc/slurm && exec "$@"', str(etc)]
    # each daemon in the foreground, in its own session, so that it is ours to stop
    argvs = {
        "munged": ["munged", "--foreground", f"--key-file={key}", f"--socket={socket_path}",
         f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={root}/munge.seed"],
        "slurmctld": [*in_namespace, "slurmctld", "-D", "-f", str(conf)],
        "slurmd": [*in_namespace, "slurmd", "-D", "-f", str(conf)],
    }
    daemons = []
    try:
        for name, argv in argvs.items():
            daemons.append(subprocess.Popen(argv, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                            stderr=open(root / f"{name}.stderr", "w")))
            if name == "munged":
                _wait_for(socket_path, daemons[0], root / "munged.stderr")
        _wait_for_idle_node(env, [root / "slurmctld.log", root / "slurmd.log"])
        yield env
    finally:
        if daemons[1:]:
            subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True)
        for daemon in reversed(daemons):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon.pid, signal.SIGTERM)
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait()
        shutil.rmtree(sockets, ignore_errors=True)


def _wait_for(path: Path, daemon: subprocess.Popen, stderr: Path, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear: {stderr.read_text()[-2000:]}")
        time.sleep(0.1)
