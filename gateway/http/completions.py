"""`POST /v1/chat/completions` and `POST /v1/completions`, as a plain ASGI endpoint.

Plain ASGI because the gateway must notice a client that goes away at any moment — while its
request is queued, while the engine thinks, mid-stream — and then close the upstream request
(which aborts it inside vLLM) and release the reservation. A watcher task reads `receive()`
for `http.disconnect` and cancels the work; `finally` does the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field

import aiohttp
from starlette.types import Receive, Scope, Send

from gateway.core.types import EngineSpec, TenantPolicy
from gateway.errors import GatewayError, ModelNotFound, RateLimited, UpstreamUnavailable
from gateway.http.errors import rate_limit_headers, send_error, sse_error_event
from gateway.http.parse import Inbound, Kind, parse_body
from gateway.proxy import UpstreamResponse
from gateway.runtime import Runtime
from gateway.service import Admitted
from gateway.state.base import DEFAULT_TENANT, Lease
from gateway.usage import UsageMeter

log = logging.getLogger(__name__)

PATHS: dict[Kind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
# The `model` label of requests naming a model no engine serves.
UNKNOWN_MODEL = "unknown"
# Response headers passed from the engine to the client.
PASS_BACK = (b"content-type", b"content-length", b"content-encoding", b"cache-control")


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class _ClientGone(Exception):
    pass


class CompletionsEndpoint:
    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self.path = PATHS[kind]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        runtime: Runtime = scope["app"].state.runtime
        request_id = _request_id(scope)
        try:
            body = await _read_body(receive, runtime.cfg.upstream.max_body_bytes)
        except _ClientGone:
            return
        except GatewayError as e:
            await send_error(send, e, request_id)
            return
        auth = _header(scope, b"authorization")
        work = asyncio.ensure_future(self._serve(runtime, body, request_id, auth, send))
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
        self, runtime: Runtime, body: bytes, request_id: str, auth: str | None, send: Send
    ) -> None:
        call = _Call(runtime, request_id)
        try:
            call.tenant = runtime.auth.tenant(auth)
            inbound = parse_body(body, self.kind)
            call.streaming, call.model = inbound.stream, inbound.model
            engine, response = await self._admit_and_open(call, inbound, body)
            try:
                await self._relay(call, engine, response, send)
            finally:
                await response.aclose()
        except GatewayError as e:
            call.outcome = e.code or str(e.status)
            if isinstance(e, ModelNotFound):
                # Any string a client sends would otherwise become a metric label forever.
                call.model = UNKNOWN_MODEL
            if isinstance(e, RateLimited) and not call.started:
                extra = await rate_limit_headers(runtime, call.tenant)
                e.headers.update((k.decode(), v.decode()) for k, v in extra)
            await _fail(send, e, call)
        except (OSError, aiohttp.ClientError) as e:  # the client's socket broke while we sent
            log.info("request %s: connection lost: %s", request_id, type(e).__name__)
        except Exception:
            call.outcome = "internal_error"
            log.exception("request %s failed", request_id)
            await _fail(send, GatewayError("internal error in the gateway; see its log"), call)
        finally:
            runtime.metrics.requests.labels(call.model, call.outcome).inc()
            if call.lease is not None:
                used = call.meter.total_tokens() if call.meter is not None else None
                if call.nothing_generated:
                    used = 0  # the whole charge comes back
                # Otherwise an unknown usage (a client gone before a whole answer arrived, a
                # timeout) keeps the charge: the engine may have generated all of it.
                if call.completed and call.meter is not None and call.admitted is not None:
                    generated = call.meter.completion_tokens()
                    if generated is not None:
                        runtime.service.observe_output(
                            call.model, call.admitted.shape, generated, call.tenant.name
                        )
                # Shielded: a second cancellation must not lose the release.
                await asyncio.shield(runtime.service.release(call.lease, used))

    async def _admit_and_open(
        self, call: _Call, inbound: Inbound, body: bytes
    ) -> tuple[EngineSpec, UpstreamResponse]:
        """Reserve, then open the upstream request. A connection failure before any byte
        ejects the engine and moves the reservation to another engine, once: released
        first, taken again there, never counted twice."""
        runtime = call.runtime
        arrived = time.monotonic()
        admitted = await runtime.service.admit(inbound, call.tenant)
        runtime.metrics.admission_wait.labels(call.model).observe(time.monotonic() - arrived)
        call.lease = admitted.lease
        headers = _upstream_headers(call.request_id)
        try:
            response = await runtime.upstream.open(
                admitted.engine.url, self.path, body, headers, streaming=call.streaming
            )
        except UpstreamUnavailable as e:
            runtime.monitor.eject(admitted.engine.name, e.message)
            lease, call.lease = call.lease, None
            # The engine never saw it: its tokens come back before they are charged again.
            # Shielded: a client leaving now must not lose the release.
            await asyncio.shield(runtime.service.release(lease, 0))
            admitted = await runtime.service.admit(
                inbound,
                call.tenant,
                exclude=frozenset({admitted.engine.name}),
                shape=admitted.shape,
            )
            call.lease = admitted.lease
            try:
                response = await runtime.upstream.open(
                    admitted.engine.url, self.path, body, headers, streaming=call.streaming
                )
            except UpstreamUnavailable:
                call.nothing_generated = True  # never reached the second engine either
                raise
        call.meter = UsageMeter(streaming=call.streaming, prompt_tokens=admitted.prompt_tokens)
        call.admitted = admitted
        return admitted.engine, response

    async def _relay(
        self, call: _Call, engine: EngineSpec, response: UpstreamResponse, send: Send
    ) -> None:
        """The engine's answer to the client, byte for byte, metering usage on the way."""
        if response.status_code >= 400:
            call.nothing_generated = True  # the engine refused or failed it
        if response.status_code >= 500:
            text = (await response.read()).decode(errors="replace")[:500]
            raise UpstreamUnavailable(
                f"engine {engine.name!r} answered {response.status_code}: {text}"
            )
        ok = response.status_code == 200
        # The monitor reads these: an engine whose answers keep coming, and that starts new
        # ones, is not hung, however slow its /health (see engines/monitor.py).
        state = call.runtime.pool.get(engine.name) if ok else None
        if state is not None:
            state.progress += 1
            state.starts += 1
        headers = [(k, v) for k, v in response.raw_headers if k.lower() in PASS_BACK]
        headers.append((b"x-request-id", call.request_id.encode()))
        headers.append((b"x-kv-gateway-engine", engine.name.encode()))
        headers += await rate_limit_headers(call.runtime, call.tenant, call.lease)
        await send(
            {"type": "http.response.start", "status": response.status_code, "headers": headers}
        )
        call.started = True
        call.outcome = str(response.status_code)
        meter = call.meter
        assert meter is not None
        # A predicted reservation may be outgrown: a stream's lease follows its tokens.
        follow = call.streaming and call.runtime.service.reservation == "predicted"
        metrics = call.runtime.metrics
        first = True
        async for chunk in response.chunks():
            if state is not None:
                state.progress += 1
            meter.feed(chunk)
            if follow:
                await _top_up(call, meter.streamed_tokens)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if first and ok:
                metrics.first_byte.labels(call.model).observe(time.monotonic() - call.arrived)
                first = False
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        call.completed = ok
        if ok:
            metrics.duration.labels(call.model).observe(time.monotonic() - call.arrived)


@dataclass
class _Call:
    """One request's state on its way through, for clean-up and metrics in `finally`."""

    runtime: Runtime
    request_id: str
    arrived: float = field(default_factory=time.monotonic)
    tenant: TenantPolicy = DEFAULT_TENANT
    model: str = ""
    streaming: bool = False
    started: bool = False
    outcome: str = "cancelled"
    lease: Lease | None = None
    meter: UsageMeter | None = None
    admitted: Admitted | None = None
    completed: bool = False  # the engine's whole 200 answer reached the client
    # Provably no tokens generated: the engine could not be reached, or answered an error.
    nothing_generated: bool = False


async def _top_up(call: _Call, generated: int) -> None:
    """Extend the lease of a stream that outgrew it, so admission counts its blocks now."""
    assert call.admitted is not None and call.lease is not None
    service = call.runtime.service
    more = service.top_up(call.admitted, call.lease, generated)
    if more:
        before = call.lease.blocks
        call.lease = await service.extend(call.lease, more)
        if call.lease.blocks > before:  # not when the store could not extend it
            call.runtime.metrics.extended_blocks.labels(call.model).inc(call.lease.blocks - before)


async def _fail(send: Send, error: GatewayError, call: _Call) -> None:
    with contextlib.suppress(OSError):
        if not call.started:
            await send_error(send, error, call.request_id)
        elif call.streaming:
            await send(
                {"type": "http.response.body", "body": sse_error_event(error), "more_body": False}
            )
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            text: str = bytes(value).decode("latin-1").strip()
            return text
    return None


def _request_id(scope: Scope) -> str:
    given = _header(scope, b"x-request-id")
    if given and len(given) <= 128:
        return given
    return uuid.uuid4().hex


def _upstream_headers(request_id: str) -> dict[str, str]:
    return {
        "content-type": "application/json",
        "accept-encoding": "identity",
        "x-request-id": request_id,
    }


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
