"""The streaming client against a stand-in server that answers as vLLM does with return_token_ids."""

import asyncio
import json

import aiohttp
from aiohttp import web
from support import completions_server

from kvpool.engine.client import complete, new_session


async def token_ids_stream(request):
    """vLLM's first event with return_token_ids carries the whole prompt's token ids on one line."""
    body = await request.json()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    first = {"choices": [{"text": "", "prompt_token_ids": body["prompt"], "token_ids": []}]}
    events = [first] + [{"choices": [{"text": f" w{i}", "token_ids": [100 + i]}]} for i in range(body["max_tokens"])]
    events.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                            "prompt_tokens_details": {"cached_tokens": 0}}})
    await response.write("".join(f"data: {json.dumps(event)}\n\n" for event in events).encode() + b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def ask(prompt_tokens: int, session_factory):
    async with completions_server(token_ids_stream, client_max_size=2**26) as url, session_factory() as session:
        return await complete(session, url, [123456] * prompt_tokens, 4, 30.0, token_ids=True)


def test_a_long_prompts_token_ids_line_is_read():
    """A 256K-token prompt's first event is a ~2 MB line; seen on the H200 at Study B's 32K sessions."""
    result = asyncio.run(ask(262144, new_session))
    assert result.ok, result.error
    assert result.output_token_ids == [100, 101, 102, 103] and result.prompt_tokens == 262144


def test_a_line_past_the_sessions_limit_is_an_error_of_the_request_not_a_crash():
    result = asyncio.run(ask(65536, aiohttp.ClientSession))  # aiohttp's default 128 KiB line limit
    assert not result.ok and "LineTooLong" in result.error
