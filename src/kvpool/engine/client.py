"""One streamed completion request, timed on the client: TTFT is the first streamed chunk."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

from kvpool.engine.plan import SERVED_MODEL_NAME

# vLLM's return_token_ids sends the prompt's token ids in the first streamed event: one line of about
# 7 bytes per prompt token, past aiohttp's line limit (twice read_bufsize, 128 KiB by default) from
# about 20K tokens on. A 16 MiB buffer takes lines of 32 MiB, over 4M tokens.
READ_BUFSIZE = 2**24


# vLLM's API server (uvicorn) closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); a client that
# kept it longer (aiohttp keeps one 15 s) could send on a socket the server is closing and read "Server
# disconnected" for a request the replica never saw. Idle connections are dropped well before the server's.
KEEPALIVE_S = 2.0


def new_session() -> aiohttp.ClientSession:
    """The client session every phase sends its requests through."""
    return aiohttp.ClientSession(read_bufsize=READ_BUFSIZE,
                                 connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S))


@dataclass
class RequestResult:
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_text: str = ""
    output_token_ids: list[int] = field(default_factory=list)  # filled when asked for (``return_token_ids``)
    error: str = ""
    started_at: float = field(default_factory=time.time)  # wall clock, lines up with telemetry
    request_id: str | None = None  # the server's id of the completion, as its logs name the request

    @property
    def ok(self) -> bool:
        return not self.error


async def complete(session: aiohttp.ClientSession, base_url: str, prompt: list[int], output_tokens: int,
                   timeout_s: float, cache_salt: str | None = None, token_ids: bool = False) -> RequestResult:
    """Send ``prompt`` (token ids) for a greedy streamed completion; failures come back as data.

    A ``cache_salt`` keeps the request from reusing, or leaving behind, prefix-cache blocks that
    requests without the same salt could use. With ``token_ids`` the answer's token ids come back
    too (vLLM's ``return_token_ids``), so a next turn can extend the prompt by exactly them.
    """
    payload = {
        "model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": output_tokens, "min_tokens": output_tokens,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
    }
    if cache_salt is not None:
        payload["cache_salt"] = cache_salt
    if token_ids:
        payload["return_token_ids"] = True
    result = RequestResult()
    start = time.perf_counter()
    try:
        async with session.post(f"{base_url}/v1/completions", json=payload,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:500]}"
                return result
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                result.request_id = result.request_id or chunk.get("id")
                if chunk.get("choices"):
                    if result.ttft_s != result.ttft_s:  # first streamed chunk (nan check)
                        result.ttft_s = time.perf_counter() - start
                    result.output_text += chunk["choices"][0].get("text") or ""
                    result.output_token_ids += chunk["choices"][0].get("token_ids") or []
                if usage := chunk.get("usage"):
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        result.e2e_s = time.perf_counter() - start
        if result.ttft_s != result.ttft_s:
            result.error = "stream ended without a token"
        elif token_ids and len(result.output_token_ids) != output_tokens:
            result.error = (f"asked for the answer's token ids and got {len(result.output_token_ids)} of "
                            f"{output_tokens} (does this vLLM support return_token_ids?)")
    except (aiohttp.ClientError, aiohttp.http_exceptions.HttpProcessingError, TimeoutError,
            json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result
