"""The engine counter against real /tokenize servers on 127.0.0.1 (real sockets)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.tokens import EngineTokenizeError, HfTokenizer, make_counter
from tests.tokens.conftest import MODEL, TokenizeServer

CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
]


async def test_counts_equal_the_engine_tokenizer(
    engine_a: TokenizeServer, client: httpx.AsyncClient, tiny: HfTokenizer
) -> None:
    counter = make_counter(
        "engine", model=MODEL, tokenize_urls=lambda: [engine_a.url], client=client
    )
    assert counter.name == "engine"
    prompt = "def main():\n    print('hello')\n"
    assert await counter.count_prompt(prompt) == len(tiny.encode(prompt))
    assert await counter.count_chat(CHAT) == tiny.count_chat(CHAT)
    assert await counter.count_chat(CHAT, add_generation_prompt=False) == tiny.count_chat(
        CHAT, add_generation_prompt=False
    )
    assert engine_a.bodies == [
        {"model": MODEL, "prompt": prompt},
        {"model": MODEL, "messages": CHAT, "add_generation_prompt": True},
        {"model": MODEL, "messages": CHAT, "add_generation_prompt": False},
    ]


async def test_next_url_after_connection_refused(
    engine_a: TokenizeServer, closed_url: str, client: httpx.AsyncClient
) -> None:
    counter = make_counter(
        "engine", model=MODEL, tokenize_urls=lambda: [closed_url, engine_a.url], client=client
    )
    assert await counter.count_prompt("abc") > 0
    assert engine_a.hits == 1


async def test_next_url_after_5xx(
    engine_a: TokenizeServer, engine_b: TokenizeServer, client: httpx.AsyncClient
) -> None:
    engine_a.fail_with = 500
    counter = make_counter(
        "engine", model=MODEL, tokenize_urls=lambda: [engine_a.url, engine_b.url], client=client
    )
    assert await counter.count_prompt("abc") > 0
    assert (engine_a.hits, engine_b.hits) == (1, 1)


async def test_4xx_is_final_and_carries_the_engine_message(
    engine_a: TokenizeServer, engine_b: TokenizeServer, client: httpx.AsyncClient
) -> None:
    counter = make_counter(
        "engine", model="other", tokenize_urls=lambda: [engine_a.url, engine_b.url], client=client
    )
    with pytest.raises(EngineTokenizeError, match="does not exist") as info:
        await counter.count_prompt("abc")
    assert info.value.status == 404
    assert engine_b.hits == 0


async def test_all_urls_down_is_a_clear_error(closed_url: str, client: httpx.AsyncClient) -> None:
    counter = make_counter(
        "engine", model=MODEL, tokenize_urls=lambda: [closed_url, closed_url + "/"], client=client
    )
    with pytest.raises(EngineTokenizeError, match="no engine could count tokens") as info:
        await counter.count_chat(CHAT)
    assert len(info.value.attempts) == 2
    assert all("ConnectError" in a for a in info.value.attempts)


async def test_no_urls_is_a_clear_error(client: httpx.AsyncClient) -> None:
    counter = make_counter("engine", model=MODEL, tokenize_urls=lambda: [], client=client)
    with pytest.raises(EngineTokenizeError, match="no engine URL"):
        await counter.count_prompt("abc")


async def test_urls_are_asked_on_every_count(
    engine_a: TokenizeServer, engine_b: TokenizeServer, client: httpx.AsyncClient
) -> None:
    order = [[engine_a.url], [engine_b.url]]
    counter = make_counter("engine", model=MODEL, tokenize_urls=lambda: order.pop(0), client=client)
    await counter.count_prompt("x")
    await counter.count_prompt("y")
    assert (engine_a.hits, engine_b.hits) == (1, 1)


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(200, json={"tokens": [1, 2]}),
        httpx.Response(200, json={"count": -1}),
        httpx.Response(200, json={"count": True}),
        httpx.Response(200, text="not json"),
    ],
)
async def test_an_answer_without_a_valid_count_is_an_error(answer: httpx.Response) -> None:
    # A misbehaving engine: httpx's transport seam stands in for it.
    transport = httpx.MockTransport(lambda request: answer)
    async with httpx.AsyncClient(transport=transport) as c:
        counter = make_counter("engine", model=MODEL, tokenize_urls=lambda: ["http://e"], client=c)
        with pytest.raises(EngineTokenizeError, match="valid 'count'"):
            await counter.count_prompt("abc")


async def test_flat_legacy_error_body_is_read() -> None:
    legacy = {"object": "error", "message": "bad prompt", "type": "BadRequestError", "code": 400}
    transport = httpx.MockTransport(lambda request: httpx.Response(400, json=legacy))
    async with httpx.AsyncClient(transport=transport) as c:
        counter = make_counter("engine", model=MODEL, tokenize_urls=lambda: ["http://e"], client=c)
        with pytest.raises(EngineTokenizeError, match="HTTP 400: bad prompt"):
            await counter.count_prompt("abc")
