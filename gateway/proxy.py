"""Forwarding to an engine with one pooled httpx client.

Bytes pass through unchanged in both directions. Low-level failures are mapped here, at the
boundary, to the gateway's error tree: unreachable → 502, too slow → 504.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx

from gateway.config import UpstreamConfig
from gateway.errors import UpstreamTimeout, UpstreamUnavailable

# Request headers the engine should see; everything else (auth, cookies) stays at the gateway.
FORWARD_HEADERS = ("content-type", "accept", "x-request-id", "user-agent")


class Upstream:
    def __init__(self, cfg: UpstreamConfig, transport: httpx.AsyncBaseTransport | None = None):
        self.cfg = cfg
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=cfg.connect_timeout_s, read=None, write=cfg.connect_timeout_s, pool=None
            ),
            limits=httpx.Limits(
                max_connections=cfg.max_connections, max_keepalive_connections=cfg.max_connections
            ),
            transport=transport,
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    async def open(
        self, base_url: str, path: str, body: bytes, headers: dict[str, str]
    ) -> httpx.Response:
        """Send the request and return once the engine's status and headers arrived."""
        request = self.client.build_request("POST", base_url + path, content=body, headers=headers)
        try:
            async with asyncio.timeout(self.cfg.first_byte_timeout_s):
                return await self.client.send(request, stream=True)
        except TimeoutError:
            raise UpstreamTimeout(
                f"the engine at {base_url} did not answer within "
                f"{self.cfg.first_byte_timeout_s:g} s"
            ) from None
        except httpx.TimeoutException as e:
            raise UpstreamTimeout(
                f"the engine at {base_url} timed out: {type(e).__name__}"
            ) from None
        except httpx.TransportError as e:
            raise UpstreamUnavailable(
                f"the engine at {base_url} could not be reached: {type(e).__name__}"
            ) from None

    async def chunks(self, response: httpx.Response) -> AsyncIterator[bytes]:
        """The engine's body as it arrives; a silence longer than `idle_timeout_s` is an error."""
        iterator = response.aiter_raw().__aiter__()
        while True:
            try:
                async with asyncio.timeout(self.cfg.idle_timeout_s):
                    chunk = await iterator.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise UpstreamTimeout(
                    f"the engine sent nothing for {self.cfg.idle_timeout_s:g} s"
                ) from None
            except httpx.HTTPError as e:
                raise UpstreamUnavailable(
                    f"the engine's answer broke off: {type(e).__name__}"
                ) from None
            yield chunk
