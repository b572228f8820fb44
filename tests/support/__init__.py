"""What the tests share that is not a fixture: the repository's paths, a shipped config as the Snakefile
resolves it, a stand-in completions endpoint, the gate inputs a unit's own flag must fail against, and a
child's Ctrl-C as in a terminal."""

import contextlib
import signal
from pathlib import Path

import pandas as pd
import yaml
from aiohttp import web

from kvpool.config import resolve_extends, validated

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "tests" / "configs"


def shipped(name: str) -> dict:
    """``config/<name>`` over the configs it extends, with the schema's defaults, as the Snakefile resolves it."""
    found = yaml.safe_load((REPO / "config" / name).read_text())
    resolve_extends(found, REPO)
    validated(found, REPO)
    return found


def completions_server(handler, **app_settings):
    """A stand-in OpenAI completions endpoint on a free loopback port: ``handler`` answers
    POST /v1/completions; yields the base URL and stops the server on exit."""
    return stand_in_server({"/v1/completions": handler}, **app_settings)


@contextlib.asynccontextmanager
async def stand_in_server(handlers: dict, **app_settings):
    """A stand-in HTTP server on a free loopback port, each POST path answered by its handler; yields the base
    URL and stops the server on exit."""
    app = web.Application(**app_settings)
    app.add_routes([web.post(path, handler) for path, handler in handlers.items()])
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
    the run's gate reads them: what a unit's flag alone must fail."""
    validity = folder / "validity.csv"
    pd.DataFrame([{"cell": cell_name, "valid": True, "reasons": ""}]).to_csv(validity, index=False)
    kv_bytes = folder / "kv_bytes.csv"
    kv_bytes.write_text("backend,chunk,tier,comparison,keys,equal,differ,bit_exact_expected,example_key,meaning\n")
    return str(validity), str(kv_bytes)


def as_in_a_terminal():
    """A child process's ``preexec_fn``: Ctrl-C's default action. A shell without job control starts background
    commands with SIGINT ignored, pytest run that way passes that on, and an ignored signal stays ignored in a
    child (bash cannot even trap it). A run someone can press Ctrl-C on has the default, which is what the tests
    that send SIGINT stand for."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
