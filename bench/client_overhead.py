"""What kvpool's client adds to each request it times, so that it is never what saturates.

Runs kvpool's own client (`kvpool.engine.client.complete`: one aiohttp session, streaming) against a
stand-in OpenAI completions server in another process that answers at once, and prints TTFT and
end-to-end percentiles per request at a given number in flight, and the client process's own CPU
time per request. The stand-in does no work, so the TTFTs bound what the client (plus loopback
HTTP and the stand-in's handling) adds to every measured TTFT; at many in flight they also queue
behind whichever of the two processes saturates first.

    python bench/client_overhead.py [--in-flight 32] [--requests 4000] [--compare-ttft-s 0.451]

`--compare-ttft-s` (default: the CPU default run's shared-arm TTFT p50) prints the overhead as a
share of it. A benchmark that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import urllib.request

import aiohttp
import numpy as np

from kvpool.engine.client import complete
from kvpool.engine.ports import free_ports


def serve(port: int, output_tokens: int) -> None:
    """The stand-in: every completion streams ``output_tokens`` one-word chunks, then usage, at once."""
    from aiohttp import web

    chunk = "data: " + json.dumps({"choices": [{"text": " w1"}]}) + "\n\n"
    usage = "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 1, "prompt_tokens_details":
                                                            {"cached_tokens": 0}}}) + "\n\n"

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write((chunk * output_tokens + usage + "data: [DONE]\n\n").encode())
        await response.write_eof()
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions), web.get("/health", health)])
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def measure(url: str, requests: int, in_flight: int, prompt_tokens: int, output_tokens: int) -> tuple:
    prompt = list(range(prompt_tokens))
    limit = asyncio.Semaphore(in_flight)
    connector = aiohttp.TCPConnector(limit=in_flight)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one():
            async with limit:
                return await complete(session, url, prompt, output_tokens, timeout_s=60)

        await asyncio.gather(*(one() for _ in range(min(requests, 200))))  # warm up connections
        started, cpu = time.perf_counter(), time.process_time()
        results = await asyncio.gather(*(one() for _ in range(requests)))
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    return results, elapsed, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--prompt-tokens", type=int, default=6200, help="token ids sent per request")
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--compare-ttft-s", type=float, default=0.451,
                        help="a TTFT p50 to state the overhead against (the CPU default's shared arm)")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.output_tokens)
        return
    (port,) = free_ports("127.0.0.1", 1)
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--output-tokens",
                               str(args.output_tokens)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the stand-in server did not start") from None
                time.sleep(0.1)
        results, elapsed, cpu = asyncio.run(measure(f"http://127.0.0.1:{port}", args.requests, args.in_flight,
                                               args.prompt_tokens, args.output_tokens))
    finally:
        server.terminate()
        server.wait(timeout=10)
    errors = [r.error for r in results if r.error]
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
    ttft = np.array([r.ttft_s for r in results]) * 1000
    e2e = np.array([r.e2e_s for r in results]) * 1000
    print(f"{args.requests} requests, {args.in_flight} in flight, {args.prompt_tokens} prompt token ids, "
          f"{args.output_tokens} streamed tokens each; {args.requests / elapsed:.0f} requests/s")
    for name, values in (("TTFT", ttft), ("end to end", e2e)):
        p50, p99 = np.percentile(values, [50, 99])
        print(f"{name:>10}: p50 {p50:.3f} ms, p99 {p99:.3f} ms, mean {values.mean():.3f} ms")
    print(f"the client's own CPU time per request: {1000 * cpu / args.requests:.3f} ms "
          f"(wall clock per request: {1000 * elapsed / args.requests:.3f} ms)")
    print(f"TTFT p50 against {args.compare_ttft_s} s: {np.percentile(ttft, 50) / (10 * args.compare_ttft_s):.3f}%")


if __name__ == "__main__":
    main()
