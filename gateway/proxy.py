"""Forwarding to an engine with one pooled httpx client.

Bytes pass through unchanged in both directions. Low-level failures are mapped here, at the
boundary, to the gateway's error tree: unreachable → 502, too slow → 504.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from gateway.config import UpstreamConfig
from gateway.errors import UpstreamTimeout, UpstreamUnavailable

KEEPALIVE_S = 2.0


class Upstream:
    def __init__(self, cfg: UpstreamConfig, transport: httpx.AsyncBaseTransport | None = None):
        self.cfg = cfg
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=cfg.connect_timeout_s, read=None, write=cfg.connect_timeout_s, pool=None
            ),
            limits=httpx.Limits(
                max_connections=cfg.max_connections,
                max_keepalive_connections=cfg.max_connections,
                # Shorter than the engines' own keep-alive (uvicorn's, vLLM's: 5 s), so the
                # gateway drops an idle connection before the engine closes it under a request:
                # that race would look like an engine failure.
                keepalive_expiry=KEEPALIVE_S,
            ),
            transport=transport,
        )
        # The read timeout is per network read: for a stream, the longest silence between two
        # chunks; for a whole answer, the wait for it. One timer per read, none of our own.
        self._timeouts = {
            True: httpx.Timeout(
                connect=cfg.connect_timeout_s,
                read=cfg.idle_timeout_s,
                write=cfg.connect_timeout_s,
                pool=None,
            ),
            False: httpx.Timeout(
                connect=cfg.connect_timeout_s,
                read=cfg.first_byte_timeout_s,
                write=cfg.connect_timeout_s,
                pool=None,
            ),
        }

    async def aclose(self) -> None:
        await self.client.aclose()

    async def open(
        self, base_url: str, path: str, body: bytes, headers: dict[str, str], *, streaming: bool
    ) -> httpx.Response:
        """Send the request and return once the engine's status and headers arrived."""
        request = self.client.build_request(
            "POST",
            base_url + path,
            content=body,
            headers=headers,
            timeout=self._timeouts[streaming],
        )
        try:
            return await self.client.send(request, stream=True)
        except httpx.TimeoutException as e:
            raise UpstreamTimeout(
                f"the engine at {base_url} timed out ({type(e).__name__}); limits: "
                f"connect {self.cfg.connect_timeout_s:g} s, "
                f"{'idle' if streaming else 'answer'} "
                f"{self.cfg.idle_timeout_s if streaming else self.cfg.first_byte_timeout_s:g} s"
            ) from None
        except httpx.TransportError as e:
            raise UpstreamUnavailable(
                f"the engine at {base_url} could not be reached: {type(e).__name__}"
            ) from None

    async def chunks(self, response: httpx.Response) -> AsyncIterator[bytes]:
        """The engine's body as it arrives; a silence longer than the read timeout is an error."""
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.ReadTimeout:
            raise UpstreamTimeout(
                f"the engine sent nothing for {self.cfg.idle_timeout_s:g} s"
            ) from None
        except httpx.HTTPError as e:
            raise UpstreamUnavailable(
                f"the engine's answer broke off: {type(e).__name__}"
            ) from None
