"""Slow clients and connection caps at the gateway's listener (`gateway/http/listener.py`),
over real sockets: headers and body must arrive within their limits (408), connections over
a cap are refused (503), and a request that did arrive is never cut, however long it streams.
"""

import asyncio
import contextlib
import dataclasses
import time

import httpx

from tests.admin import ADMIN_HEADERS
from tests.integration.conftest import FAST, gateway_over

LIMIT_S = 0.5
MARGIN_S = 3.0  # a busy 2-core machine: generous, the point is "cut", not "cut at 0.5 s"
CLIENTS = {"header_timeout_s": LIMIT_S, "body_timeout_s": LIMIT_S}
HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    u = httpx.URL(url)
    return await asyncio.open_connection(u.host, u.port)


async def trickle_until_cut(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, piece: bytes
) -> tuple[bytes, float]:
    """Send `piece` every 0.1 s until the server answers or closes; what it sent, and when."""
    started = time.monotonic()
    answer = b""
    while time.monotonic() - started < LIMIT_S + MARGIN_S:
        with contextlib.suppress(ConnectionError):
            writer.write(piece)
            await writer.drain()
        try:
            chunk = await asyncio.wait_for(reader.read(4096), timeout=0.1)
        except TimeoutError:
            continue
        answer += chunk
        if not chunk:  # closed
            break
    return answer, time.monotonic() - started


async def test_a_client_sending_headers_slowly_is_cut_off_with_408():
    async with gateway_over([FAST], clients=CLIENTS) as gw:
        reader, writer = await connect(gw.url)
        writer.write(HEAD)
        answer, after = await trickle_until_cut(reader, writer, b"x-slow: 1\r\n")
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b'"code": "request_timeout"' in answer and b"connection: close" in answer
        assert LIMIT_S * 0.8 <= after < LIMIT_S + MARGIN_S, after


async def test_an_idle_connection_is_closed_quietly():
    async with gateway_over([FAST], clients=CLIENTS) as gw:
        reader, writer = await connect(gw.url)
        started = time.monotonic()
        answer = await asyncio.wait_for(reader.read(), timeout=LIMIT_S + MARGIN_S)
        assert answer == b"" and time.monotonic() - started >= LIMIT_S * 0.8
        writer.close()


async def test_a_client_sending_its_body_slowly_is_cut_off_and_holds_nothing():
    async with gateway_over([FAST], clients=CLIENTS) as gw:
        reader, writer = await connect(gw.url)
        writer.write(HEAD + b"content-length: 200\r\n\r\n" + b'{"model": "tiny", ')
        answer, after = await trickle_until_cut(reader, writer, b" ")
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert LIMIT_S * 0.8 <= after < LIMIT_S + MARGIN_S, after
        assert not any(await gw.reserved_blocks_settle())
        async with httpx.AsyncClient() as http:
            page = (await http.get(gw.url + "/metrics", headers=ADMIN_HEADERS)).text
        assert 'kv_gateway_client_cutoffs_total{reason="body_timeout"} 1.0' in page


async def test_an_answer_streaming_longer_than_the_limits_is_not_cut():
    slow = dataclasses.replace(FAST, decode_ms_base=25.0)  # 60 tokens: ~1.5 s
    async with gateway_over([slow], clients=CLIENTS) as gw, httpx.AsyncClient(timeout=30) as http:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 60, "ignore_eos": True}
        for _ in range(2):  # the second on the kept-alive connection
            started = time.monotonic()
            async with http.stream(
                "POST", gw.url + "/v1/completions", json=body | {"stream": True}
            ) as r:
                text = "".join([part async for part in r.aiter_text()])
            assert r.status_code == 200 and text.rstrip().endswith("data: [DONE]")
            assert time.monotonic() - started > 2 * LIMIT_S


async def test_connections_over_a_cap_are_refused_with_503():
    clients = CLIENTS | {"header_timeout_s": 30.0, "max_connections_per_address": 2}
    async with gateway_over([FAST], clients=clients) as gw:
        held = [await connect(gw.url) for _ in range(2)]
        reader, writer = await connect(gw.url)
        answer = await asyncio.wait_for(reader.read(), timeout=MARGIN_S)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503 "), answer
        assert b'"code": "too_many_connections"' in answer and b"retry-after: 1" in answer
        held.pop()[1].close()
        async with httpx.AsyncClient(timeout=10) as http:
            deadline = time.monotonic() + MARGIN_S
            while True:  # until the server has seen the close
                with contextlib.suppress(httpx.TransportError):
                    r = await http.post(gw.url + "/v1/completions", json={"model": "tiny"})
                    if r.status_code == 400:
                        break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
        for _, w in held:
            w.close()


async def test_the_overall_cap():
    async with gateway_over([FAST], clients={"max_connections": 3}) as gw:
        held = [await connect(gw.url) for _ in range(3)]
        reader, writer = await connect(gw.url)
        answer = await asyncio.wait_for(reader.read(), timeout=MARGIN_S)
        assert answer.startswith(b"HTTP/1.1 503 "), answer
        writer.close()
        for _, w in held:
            w.close()


async def test_headers_are_timed_after_an_answer_that_ended_before_its_body():
    """A 413 is answered while the body still arrives; the next request on that connection
    is timed all the same."""
    upstream = {"max_body_bytes": 100}
    async with gateway_over([FAST], clients=CLIENTS, upstream=upstream) as gw:
        reader, writer = await connect(gw.url)
        writer.write(HEAD + b"content-length: 300\r\n\r\n" + b" " * 150)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=MARGIN_S)
        assert head.startswith(b"HTTP/1.1 413 "), head
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(b" " * 150)  # the body ends after its answer
        writer.write(HEAD)
        answer, _ = await trickle_until_cut(reader, writer, b"x-slow: 1\r\n")
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408 "), answer
