import copy
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def config():
    """The embedded default config with the schema's defaults filled, as the Snakefile sees it."""
    from snakemake.utils import validate

    data = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    validate(data, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    return copy.deepcopy(data)
