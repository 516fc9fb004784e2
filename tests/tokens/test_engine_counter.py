"""The engine counter against real /tokenize servers on 127.0.0.1 (real sockets)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from gateway.tokens import EngineTokenizeError, HfTokenizer, make_counter
from gateway.tokens.chat import ChatInput
from tests.tokens.conftest import MODEL, TokenizeServer

CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
]


async def test_counts_equal_the_engine_tokenizer(
    engine_a: TokenizeServer, client: aiohttp.ClientSession, tiny: HfTokenizer
) -> None:
    counter = make_counter(
        "engine", model=MODEL, tokenize_urls=lambda: [engine_a.url], client=client
    )
    assert counter.name == "engine"
    prompt = "def main():\n    print('hello')\n"
    assert (await counter.count_prompt(prompt)).count == len(tiny.encode(prompt))
    assert (await counter.count_chat(ChatInput(CHAT))).count == tiny.count_chat(CHAT)
    assert (
        await counter.count_chat(ChatInput(CHAT, add_generation_prompt=False))
    ).count == tiny.count_chat(CHAT, add_generation_prompt=False)
    assert engine_a.bodies == [
        {"model": MODEL, "prompt": prompt},
        {
            "model": MODEL,
            "messages": CHAT,
            "add_generation_prompt": True,
            "continue_final_message": False,
        },
        {
            "model": MODEL,
            "messages": CHAT,
            "add_generation_prompt": False,
            "continue_final_message": False,
        },
    ]


async def test_next_url_after_connection_refused(
    engine_a: TokenizeServer, closed_url: str, client: aiohttp.ClientSession
) -> None:
    counter = make_counter(
        "engine", model=MODEL, tokenize_urls=lambda: [closed_url, engine_a.url], client=client
    )
    assert (await counter.count_prompt("abc")).count > 0
    assert engine_a.hits == 1


async def test_next_url_after_5xx(
    engine_a: TokenizeServer, engine_b: TokenizeServer, client: aiohttp.ClientSession
) -> None:
    engine_a.fail_with = 500
    counter = make_counter(
        "engine", model=MODEL, tokenize_urls=lambda: [engine_a.url, engine_b.url], client=client
    )
    assert (await counter.count_prompt("abc")).count > 0
    assert (engine_a.hits, engine_b.hits) == (1, 1)


async def test_4xx_is_final_and_carries_the_engine_message(
    engine_a: TokenizeServer, engine_b: TokenizeServer, client: aiohttp.ClientSession
) -> None:
    counter = make_counter(
        "engine", model="other", tokenize_urls=lambda: [engine_a.url, engine_b.url], client=client
    )
    with pytest.raises(EngineTokenizeError, match="does not exist") as info:
        await counter.count_prompt("abc")
    assert info.value.status == 404
    assert engine_b.hits == 0


async def test_all_urls_down_is_a_clear_error(
    closed_url: str, client: aiohttp.ClientSession
) -> None:
    counter = make_counter(
        "engine", model=MODEL, tokenize_urls=lambda: [closed_url, closed_url + "/"], client=client
    )
    with pytest.raises(EngineTokenizeError, match="no engine could count tokens") as info:
        await counter.count_chat(ChatInput(CHAT))
    assert len(info.value.attempts) == 2
    assert all("ClientConnectorError" in a for a in info.value.attempts)  # refused


async def test_no_urls_is_a_clear_error(client: aiohttp.ClientSession) -> None:
    counter = make_counter("engine", model=MODEL, tokenize_urls=lambda: [], client=client)
    with pytest.raises(EngineTokenizeError, match="no engine URL"):
        await counter.count_prompt("abc")


async def test_urls_are_asked_on_every_count(
    engine_a: TokenizeServer, engine_b: TokenizeServer, client: aiohttp.ClientSession
) -> None:
    order = [[engine_a.url], [engine_b.url]]
    counter = make_counter("engine", model=MODEL, tokenize_urls=lambda: order.pop(0), client=client)
    await counter.count_prompt("x")
    await counter.count_prompt("y")
    assert (engine_a.hits, engine_b.hits) == (1, 1)


@pytest.mark.parametrize(
    "answer",
    [
        (200, '{"tokens": [1, 2]}'),
        (200, '{"count": -1}'),
        (200, '{"count": true}'),
        (200, "not json"),
    ],
)
async def test_an_answer_without_a_valid_count_is_an_error(
    engine_a: TokenizeServer, client: aiohttp.ClientSession, answer: tuple[int, str]
) -> None:
    engine_a.answer = answer  # a misbehaving engine, over a real socket
    counter = make_counter(
        "engine", model=MODEL, tokenize_urls=lambda: [engine_a.url], client=client
    )
    with pytest.raises(EngineTokenizeError, match="valid 'count'"):
        await counter.count_prompt("abc")


async def test_flat_legacy_error_body_is_read(
    engine_a: TokenizeServer, client: aiohttp.ClientSession
) -> None:
    legacy = {"object": "error", "message": "bad prompt", "type": "BadRequestError", "code": 400}
    engine_a.answer = (400, json.dumps(legacy))
    counter = make_counter(
        "engine", model=MODEL, tokenize_urls=lambda: [engine_a.url], client=client
    )
    with pytest.raises(EngineTokenizeError, match="HTTP 400: bad prompt"):
        await counter.count_prompt("abc")


async def test_a_silent_engine_times_out_and_the_next_is_asked(
    engine_b: TokenizeServer, client: aiohttp.ClientSession
) -> None:
    import socket

    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        counter = make_counter(
            "engine",
            model=MODEL,
            tokenize_urls=lambda: [url, engine_b.url],
            client=client,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=1.0, sock_read=1.0),
        )
        assert (await counter.count_prompt("abc")).count > 0
    assert engine_b.hits == 1


async def test_the_gateways_tokenize_session_reads_compressed_answers(
    engine_a: TokenizeServer,
) -> None:
    """A proxy in front of the engine may gzip the JSON: the gateway's /tokenize session
    decompresses it (the completions' session passes bytes through untouched)."""
    from gateway.config import UpstreamConfig
    from gateway.proxy import Upstream

    engine_a.gzip = True
    upstream = Upstream(UpstreamConfig())
    try:
        counter = make_counter(
            "engine",
            model=MODEL,
            tokenize_urls=lambda: [engine_a.url],
            client=upstream.tokenize_session(),
            timeout=upstream.tokenize_timeout,
        )
        assert (await counter.count_prompt("hello there")).count > 0
    finally:
        await upstream.aclose()
