import contextlib
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


@contextlib.asynccontextmanager
async def completions_server(handler, **app_settings):
    """A stand-in OpenAI completions endpoint on a free loopback port: ``handler`` answers
    POST /v1/completions; yields the base URL and stops the server on exit."""
    from aiohttp import web

    app = web.Application(**app_settings)
    app.add_routes([web.post("/v1/completions", handler)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def passing_gate_inputs(folder: Path, cell_name: str) -> tuple[str, str]:
    """A run's validity table with ``cell_name`` valid and a KV bytes table with nothing damaged, as
    steps.gate reads them: what a unit's flag alone must fail."""
    import pandas as pd

    validity = folder / "validity.csv"
    pd.DataFrame([{"cell": cell_name, "valid": True, "reasons": ""}]).to_csv(validity, index=False)
    kv_bytes = folder / "kv_bytes.csv"
    kv_bytes.write_text("backend,chunk,tier,comparison,keys,equal,differ,bit_exact_expected,example_key,meaning\n")
    return str(validity), str(kv_bytes)
