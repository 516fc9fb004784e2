"""Forwarding to an engine: pooled aiohttp sessions for the data plane, one httpx client
for the control plane.

The completions clients send and the `engine` token counter's `/tokenize` calls (the data
plane: one or two calls per request) go through aiohttp, whose client costs a fraction of
httpx's CPU per request (measured in docs/benchmarks.md: the upstream client was half of the
gateway's CPU). Discovery and the health and metrics scrapes (the control plane: a few calls
per second) use `Upstream.client`, an `httpx.AsyncClient`.

Bytes pass through unchanged in both directions. Low-level failures are mapped here, at the
boundary, to the gateway's error tree: unreachable or broken off → 502, too slow → 504.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import httpx

from gateway.config import UpstreamConfig
from gateway.errors import UpstreamTimeout, UpstreamUnavailable

# Shorter than the engines' own keep-alive (uvicorn's, vLLM's: 5 s), so the gateway drops an
# idle connection before the engine closes it under a request: that race would look like an
# engine failure.
KEEPALIVE_S = 2.0


class UpstreamResponse:
    """An engine's answer: status and headers at once, the body as it arrives.

    `aclose()` must follow (in `finally`): a body read to its end gives the connection back
    to the pool; anything else closes it, which aborts the request inside vLLM.
    """

    def __init__(self, response: aiohttp.ClientResponse, base_url: str, read_timeout_s: float):
        self._response = response
        self._base_url = base_url
        self._read_timeout_s = read_timeout_s

    @property
    def status_code(self) -> int:
        return self._response.status

    @property
    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        return list(self._response.raw_headers)

    async def read(self) -> bytes:
        """The whole body (for short error answers)."""
        return b"".join([chunk async for chunk in self.chunks()])

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; a silence longer than the read timeout is an error."""
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except TimeoutError:
            raise UpstreamTimeout(
                f"the engine at {self._base_url} sent nothing for {self._read_timeout_s:g} s"
            ) from None
        except aiohttp.ClientError as e:
            raise UpstreamUnavailable(
                f"the engine's answer broke off: {type(e).__name__}"
            ) from None

    async def aclose(self) -> None:
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class Upstream:
    def __init__(self, cfg: UpstreamConfig):
        self.cfg = cfg
        # The control plane's client (discovery, the monitor's scrapes).
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=cfg.connect_timeout_s, read=None, write=cfg.connect_timeout_s, pool=None
            ),
            limits=httpx.Limits(
                max_connections=cfg.max_connections,
                max_keepalive_connections=cfg.max_connections,
                keepalive_expiry=KEEPALIVE_S,
            ),
        )
        # Made on first use, inside the event loop: one for completions, one for /tokenize,
        # each with its own pool, so that a pool full of long streams never holds back the
        # token counts of the requests waiting to be admitted.
        self._session: aiohttp.ClientSession | None = None
        self._tokenize_session: aiohttp.ClientSession | None = None
        self._media_session: aiohttp.ClientSession | None = None
        # The read timeout is per socket read: for a stream, the longest silence between two
        # chunks; for a whole answer, the wait for it. One timer per read, none of our own.
        self._read_s = {True: cfg.idle_timeout_s, False: cfg.first_byte_timeout_s}
        # A /tokenize call: connect as any call; an engine slower than this to count is
        # passed over for the next one.
        self.tokenize_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.tokenize_timeout_s
        )
        self._timeouts = {
            streaming: aiohttp.ClientTimeout(
                total=None,
                connect=None,  # waiting for a pooled connection is not limited...
                sock_connect=cfg.connect_timeout_s,  # ...opening one is
                sock_read=read_s,
            )
            for streaming, read_s in self._read_s.items()
        }

    def session(self) -> aiohttp.ClientSession:
        """The completions' session."""
        if self._session is None:
            self._session = self._new_session()
        return self._session

    def tokenize_session(self) -> aiohttp.ClientSession:
        """The `engine` token counter's session (its `/tokenize` calls are on every request's
        path too, before admission)."""
        if self._tokenize_session is None:
            # JSON read here, not relayed: a compressed answer (a proxy in front of the
            # engine) is decompressed.
            self._tokenize_session = self._new_session(auto_decompress=True)
        return self._tokenize_session

    def media_session(self) -> aiohttp.ClientSession:
        """The session remote images are fetched with (`models[].media.fetch`): its own
        pool, apart from the engines'."""
        if self._media_session is None:
            self._media_session = self._new_session(auto_decompress=True)
        return self._media_session

    def _new_session(self, *, auto_decompress: bool = False) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=self.cfg.max_connections, keepalive_timeout=KEEPALIVE_S
            ),
            # Completions: the engine's bytes go to the client as they are. Cookies mean
            # nothing here.
            auto_decompress=auto_decompress,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent",),
        )

    async def aclose(self) -> None:
        for session in (self._session, self._tokenize_session, self._media_session):
            if session is not None:
                await session.close()
        await self.client.aclose()

    async def open(
        self, base_url: str, path: str, body: bytes, headers: dict[str, str], *, streaming: bool
    ) -> UpstreamResponse:
        """Send the request and return once the engine's status and headers arrived."""
        read_s = self._read_s[streaming]
        try:
            response = await self.session().post(
                base_url + path, data=body, headers=headers, timeout=self._timeouts[streaming]
            )
        except TimeoutError as e:
            raise UpstreamTimeout(
                f"the engine at {base_url} timed out ({type(e).__name__}); limits: "
                f"connect {self.cfg.connect_timeout_s:g} s, "
                f"{'idle' if streaming else 'answer'} {read_s:g} s"
            ) from None
        except aiohttp.ClientError as e:
            raise UpstreamUnavailable(
                f"the engine at {base_url} could not be reached: {type(e).__name__}"
            ) from None
        return UpstreamResponse(response, base_url, read_s)
