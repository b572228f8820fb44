import copy
import signal
import warnings
from pathlib import Path

import psutil
import pytest
import yaml
from support import REPO


@pytest.fixture
def config():
    """The embedded default config with the schema's defaults filled, as the Snakefile sees it."""
    from snakemake.utils import validate

    data = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    validate(data, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    return copy.deepcopy(data)


@pytest.fixture
def free_disk(monkeypatch):
    """Sets the free bytes every drive reports (``shutil.disk_usage``), so a check of the tiers' room
    sees the figure the test gives, not whatever the machine running it has left."""
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")

    def set_free(free_bytes: int):
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**13, 0, free_bytes))
    return set_free


LANES = {"unit": "unit", "committed": "committed", "e2e": "e2e"}


def pytest_collection_modifyitems(items):
    """Each test's lane is its folder (tests/unit, tests/committed, tests/e2e): the marker that
    `make test-fast` and `make test` select on."""
    for item in items:
        lane = LANES.get(item.path.parent.name)
        if lane:
            item.add_marker(lane)


def pytest_configure(config):
    """A SIGTERM (CI's timeout, `kill`) ends the session as Ctrl-C does: teardown runs, and with it the
    reaper below, instead of Python exiting with fleets and pool servers still running."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def _working_under(process: psutil.Process, base: Path) -> bool:
    try:
        return Path(process.cwd()).resolve().is_relative_to(base)
    except (psutil.Error, OSError):
        return False


@pytest.fixture(scope="session", autouse=True)
def no_process_outlives_the_session(tmp_path_factory):
    """At the session's end, every process still working in the session's temporary folders (a replica,
    an LMCache MP server or Redis server of an e2e run whose workflow was cut short) is stopped, killed
    if it ignores SIGTERM, and named. The runs' own tests assert that nothing is left; this keeps one
    failure from leaving processes that slow every later session."""
    base = tmp_path_factory.getbasetemp().resolve()
    yield
    left = [process for process in psutil.process_iter() if _working_under(process, base)]
    if not left:
        return
    names = []
    for process in left:
        try:
            names.append(f"{process.pid} {' '.join(process.cmdline()[:4])}")
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(left, timeout=15)
    for process in alive:
        process.kill()
    warnings.warn(f"stopped {len(left)} processes the session left in {base}: {names}", stacklevel=1)
