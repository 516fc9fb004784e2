"""The admitted endpoints (`POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings`,
`/pooling`, `/score`, `/rerank`, `/v1/responses`, `/tokenize`, `/detokenize`), as a plain
ASGI endpoint.

Plain ASGI because the gateway must notice a client that goes away at any moment — while its
request is queued, while the engine thinks, mid-stream — and then close the upstream request
(which aborts it inside vLLM) and release the reservation. A watcher task reads `receive()`
for `http.disconnect` and cancels the work; the exchange's `settle` in `finally` does the rest.

This module speaks ASGI only: the body, the disconnect watcher, headers, `send`, errors. The
request's life after parsing (admission, failover, relay hooks, refund, release) is
`gateway.exchange`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from dataclasses import dataclass

from starlette.types import Receive, Scope, Send

from gateway.auth import Authenticator
from gateway.core.types import TenantPolicy
from gateway.errors import GatewayError, PayloadTooLarge, RateLimited, Unauthorized
from gateway.exchange import Exchange, Exchanges
from gateway.http.errors import (
    NO_NAMES,
    EngineNames,
    log_error,
    rate_limit_headers,
    send_error,
    sse_error_event,
)
from gateway.http.request_ids import request_id as request_id_of
from gateway.request import DEFAULT_MAX_DEPTH, Kind, parse_body

log = logging.getLogger(__name__)


class _ClientGone(Exception):
    pass


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """The largest body (413 beyond) and its deepest JSON nesting (400 beyond)."""

    max_bytes: int
    max_json_depth: int = DEFAULT_MAX_DEPTH


class CompletionsEndpoint:
    """`names`: which engine names clients may read (`EngineNames`); `path`: where the
    request is forwarded (default: the kind's completions path).

    Every answer that reached an engine carries what the gateway counted and reserved:
    `x-kv-gateway-prompt-tokens` (the prompt tokens as vLLM's `usage.prompt_tokens` counts
    them: each prompt once, whatever `n`; all prompts of a batch together) and
    `x-kv-gateway-blocks` (the KV blocks reserved for all its sequences: `n` × prompts)."""

    def __init__(
        self,
        kind: Kind,
        exchanges: Exchanges,
        auth: Authenticator,
        limits: BodyLimits,
        names: EngineNames = NO_NAMES,
        path: str | None = None,
    ) -> None:
        self.kind = kind
        self.path = path
        self.exchanges = exchanges
        self.auth = auth
        self.limits = limits
        self.names = names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = request_id_of(scope)
        # The key before the body: a client without a valid one is answered 401 without the
        # gateway buffering up to `max_body_bytes` of what it sends.
        authorization, named_class = _headers(scope, self.auth.class_header)
        tenant: TenantPolicy | Unauthorized
        try:
            tenant = self.auth.tenant(authorization)
        except Unauthorized as e:
            tenant = e
        body = b""
        try:
            if not isinstance(tenant, Unauthorized):
                body = await _read_body(receive, self.limits.max_bytes)
        except _ClientGone:
            return
        except GatewayError as e:
            log_error(e, request_id)
            await send_error(send, e, request_id)
            return
        work = asyncio.ensure_future(self._serve(body, request_id, tenant, named_class, send))
        watcher = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, watcher):
                task.cancel()
            for task in (work, watcher):
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _serve(
        self,
        body: bytes,
        request_id: str,
        tenant: TenantPolicy | Unauthorized,
        named_class: str | None,
        send: Send,
    ) -> None:
        """`tenant`: the key's, or its refusal (answered here, so counted as every answer);
        `named_class`: the class header's value, if sent."""
        exchange = self.exchanges.start(self.kind, request_id, self.path)
        started = False
        try:
            if isinstance(tenant, Unauthorized):
                raise tenant
            exchange.identify(tenant)
            service_class = self.auth.service_class(tenant, named_class)
            inbound = parse_body(body, self.kind, max_depth=self.limits.max_json_depth)
            if service_class is not None:
                inbound = dataclasses.replace(inbound, service_class=service_class)
            answer = await exchange.open(tenant, inbound, body)
            headers = [
                *answer.headers,
                (b"x-request-id", request_id.encode()),
                (b"x-kv-gateway-prompt-tokens", b"%d" % answer.prompt_tokens),
                (b"x-kv-gateway-blocks", b"%d" % answer.blocks),
                *rate_limit_headers(answer.rates),
            ]
            if answer.credit:
                headers.append((b"x-kv-gateway-prefix-credit", b"%d" % answer.credit))
            if answer.engine in self.names.shown:
                headers.append((b"x-kv-gateway-engine", answer.engine.encode()))
            await send({"type": "http.response.start", "status": answer.status, "headers": headers})
            started = True
            async for chunk in exchange.relay():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except GatewayError as e:
            exchange.fail(e)
            log_error(e, request_id)
            if isinstance(e, RateLimited) and not started:
                e.headers.update(
                    (k.decode(), v.decode())
                    for k, v in rate_limit_headers(await exchange.rate_limits())
                )
            await _fail(send, e, exchange, started, self.names)
        except OSError as e:  # the client's socket broke while we sent
            log.info("request %s: connection lost: %s", request_id, type(e).__name__)
        except Exception:
            internal = GatewayError("internal error in the gateway; see its log")
            exchange.fail(internal)
            log.exception("request %s failed", request_id)
            await _fail(send, internal, exchange, started, self.names)
        finally:
            await exchange.settle()


async def _fail(
    send: Send, error: GatewayError, exchange: Exchange, started: bool, names: EngineNames
) -> None:
    with contextlib.suppress(OSError):
        if not started:
            await send_error(send, error, exchange.request_id, names)
        elif exchange.streaming:
            event = sse_error_event(error, exchange.request_id)
            await send({"type": "http.response.body", "body": event, "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def _headers(scope: Scope, class_header: bytes) -> tuple[str | None, str | None]:
    """The `authorization` header and the class header (the first of each), in one pass."""
    authorization = named = None
    for key, value in scope.get("headers", []):
        if key == b"authorization":
            if authorization is None:
                authorization = bytes(value).decode("latin-1").strip()
        elif key == class_header and named is None:
            named = bytes(value).decode("latin-1").strip()
    return authorization, named


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body larger than {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _until_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
