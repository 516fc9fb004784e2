"""What a client can make the gateway hold before its API key is checked, over real sockets:
request heads over their limits get 431 (414 for the request target) and the connection is
closed without reading on (`gateway/http/listener.py`); heads within them work as before,
split across reads, kept alive or pipelined; and a request without a valid key is answered
401 before its body is read (`gateway/http/completions.py`).
"""

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import Sequence

import httpx
import pytest

from tests.admin import ADMIN_HEADERS
from tests.integration.conftest import FAST, gateway_over

HEAD = 4096
HEADER = 1024
URL = 512
COUNT = 16
LIMITS = {"max_head_bytes": HEAD, "max_header_bytes": HEADER, "max_url_bytes": URL}
CLIENTS = LIMITS | {"max_headers": COUNT}
KEY = "key-a"
TENANTS = [{"name": "a", "api_keys": [hashlib.sha256(KEY.encode()).hexdigest()]}]
WAIT_S = 5.0


def request(
    path: str = "/v1/models",
    headers: Sequence[bytes] = (),
    method: bytes = b"GET",
    body: bytes = b"",
) -> bytes:
    """A request whose head is exactly what is listed (besides the request line)."""
    lines = [method + b" " + path.encode() + b" HTTP/1.1", *headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def header(name: bytes, size: int) -> bytes:
    """`name: xxx…`, `size` bytes of name and value together."""
    return name + b": " + b"x" * (size - len(name))


async def exchange(url: str, raw: bytes) -> bytes:
    """Send `raw` at once; everything the gateway answers until it closes (or WAIT_S)."""
    u = httpx.URL(url)
    reader, writer = await asyncio.open_connection(u.host, u.port)
    try:
        writer.write(raw)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        answer = b""
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(WAIT_S):
                while chunk := await reader.read(65536):
                    answer += chunk
        return answer
    finally:
        writer.close()


def error_of(answer: bytes) -> dict[str, object]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"connection: close" in head, head
    error = json.loads(body)["error"]
    assert isinstance(error, dict)
    return error


OVER = [
    (
        "one header over its limit",
        request(headers=[b"host: gw", header(b"authorization", HEADER + 1)]),
        431,
        "request_header_fields_too_large",
    ),
    (
        "headers over the total",
        request(headers=[b"host: gw", *(header(b"x-%d" % i, HEADER) for i in range(5))]),
        431,
        "request_header_fields_too_large",
    ),
    (
        "one header over its limit, the head over the total, in one read",
        request(
            headers=[
                b"host: gw",
                header(b"x-big", HEADER + 1),
                *(header(b"x-%d" % i, HEADER) for i in range(5)),
            ]
        ),
        431,
        "request_header_fields_too_large",
    ),
    (
        "too many headers",
        request(headers=[b"host: gw", *(b"x-%d: 1" % i for i in range(COUNT))]),
        431,
        "request_header_fields_too_large",
    ),
    (
        "a request target over its limit",
        request("/v1/models?" + "q" * URL, [b"host: gw"]),
        414,
        "uri_too_long",
    ),
]


@pytest.mark.parametrize(("raw", "status", "code"), [c[1:] for c in OVER], ids=[c[0] for c in OVER])
async def test_a_head_over_a_limit_is_refused_and_the_connection_closed(raw, status, code):
    async with gateway_over([FAST], clients=CLIENTS, tenants=TENANTS) as gw:
        answer = await exchange(gw.url, raw)
        assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]
        error = error_of(answer)  # the whole answer, then the close: nothing after it
        assert error["code"] == code and error["type"] == "invalid_request_error", error
        async with httpx.AsyncClient() as http:
            page = (await http.get(gw.url + "/metrics", headers=ADMIN_HEADERS)).text
        assert f'kv_gateway_client_cutoffs_total{{reason="{code}"}} 1.0' in page


def at_the_limit(headers: list[bytes]) -> list[bytes]:
    """`headers` and more, each within `HEADER`, for a request of exactly `HEAD` bytes."""
    headers = list(headers)
    while (rest := HEAD - len(request(headers=headers)) - len(b": \r\n")) > HEADER:
        headers.append(header(b"x-%d" % len(headers), HEADER))
    return [*headers, header(b"x-fill", rest)]


UNDER = [
    ("one header at its limit", [header(b"x-big", HEADER)]),
    ("the most headers", [b"x-%d: 1" % i for i in range(COUNT - 3)]),
    (
        "a head of exactly the limit",
        at_the_limit([b"host: gw", b"authorization: Bearer key-a", b"connection: close"])[3:],
    ),
    ("a request target at its limit", []),
]


@pytest.mark.parametrize("extra", [c[1] for c in UNDER], ids=[c[0] for c in UNDER])
@pytest.mark.parametrize(("key", "status"), [(KEY, 200), ("wrong", 401)])
async def test_a_head_within_the_limits_is_served_as_before(extra, key, status):
    assert len(key) == len(KEY)  # the same head's length with either key
    headers = [b"host: gw", b"authorization: Bearer " + key.encode(), b"connection: close", *extra]
    path = "/v1/models" if extra else "/v1/models?" + "q" * (URL - len("/v1/models?"))
    raw = request(path, headers)
    assert len(headers) <= COUNT and len(raw) <= HEAD
    if len(raw) > 2 * HEADER:
        assert len(raw) == HEAD  # the case at the limit is at it
    async with gateway_over([FAST], clients=CLIENTS, tenants=TENANTS) as gw:
        answer = await exchange(gw.url, raw)
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]


async def test_a_head_and_body_in_one_read_past_the_head_limit_are_served():
    """The limit is the head's: a body arriving with it is not counted."""
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2}).encode()
    body += b" " * (2 * HEAD)  # JSON whitespace
    head = [
        b"host: gw",
        b"authorization: Bearer " + KEY.encode(),
        b"content-type: application/json",
        b"content-length: %d" % len(body),
        b"connection: close",
    ]
    raw = request("/v1/completions", head, b"POST", body)
    async with gateway_over([FAST], clients=CLIENTS, tenants=TENANTS) as gw:
        answer = await exchange(gw.url, raw)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]


async def test_the_limit_is_per_request_kept_alive_or_pipelined():
    """Two requests on one connection, each 3/4 of the limit: both served, whether the second
    follows the first's answer or arrives with it in one read."""
    headers = [b"host: gw", b"authorization: Bearer " + KEY.encode(), header(b"x-a", 1000)]
    headers += [header(b"x-b", 1000), header(b"x-c", 1000)]
    one = request(headers=headers)
    assert HEAD * 0.7 < len(one) < HEAD
    async with gateway_over([FAST], clients=CLIENTS, tenants=TENANTS) as gw:
        u = httpx.URL(gw.url)
        reader, writer = await asyncio.open_connection(u.host, u.port)
        for _ in range(2):  # kept alive
            writer.write(one)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
            assert head.startswith(b"HTTP/1.1 200 "), head
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
        writer.close()
        answer = await exchange(gw.url, one + request(headers=[*headers, b"connection: close"]))
    assert answer.count(b"HTTP/1.1 200 ") == 2, answer[:300]


async def test_an_endless_header_is_cut_off_after_about_the_limit():
    """A client that never ends its head is answered 431 and closed once the limit is read:
    what it managed to send before the answer is the limit plus the sockets' buffers, not
    everything it had to send (the gateway used to read all of it)."""
    to_send = 64 * 1024 * 1024
    async with gateway_over([FAST], clients=CLIENTS | {"header_timeout_s": 60}) as gw:
        u = httpx.URL(gw.url)
        reader, writer = await asyncio.open_connection(u.host, u.port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nhost: gw\r\nx-endless: ")
        piece, sent, answer = b"x" * 65536, 0, b""
        started = time.monotonic()
        with contextlib.suppress(ConnectionError):
            while sent < to_send and time.monotonic() - started < 30:
                writer.write(piece)
                sent += len(piece)
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    answer += await asyncio.wait_for(reader.read(65536), 0.001)
                if answer:
                    break
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(WAIT_S):
                while chunk := await reader.read(65536):
                    answer += chunk
        writer.close()
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert error_of(answer)["code"] == "request_header_fields_too_large"
    assert sent < to_send // 4, f"{sent} bytes sent before the answer"


async def test_a_request_without_a_valid_key_is_answered_before_its_body():
    """A large body announced by a client without a key is not waited for (nor buffered)."""
    async with gateway_over([FAST], clients={"body_timeout_s": 30}, tenants=TENANTS) as gw:
        for key in (b"wrong", None):
            head = [b"host: gw", b"content-type: application/json", b"content-length: 10000000"]
            if key is not None:
                head.append(b"authorization: Bearer " + key)
            u = httpx.URL(gw.url)
            reader, writer = await asyncio.open_connection(u.host, u.port)
            writer.write(request("/v1/completions", head, b"POST")[:-4] + b"\r\n\r\n{")
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 401 "), answer
