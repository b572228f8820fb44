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
