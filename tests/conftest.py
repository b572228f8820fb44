import copy

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
