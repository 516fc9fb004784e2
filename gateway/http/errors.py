"""The one place that renders errors for clients: OpenAI-shaped JSON, or an SSE event once a
stream has started. Never a stack trace."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from starlette.types import Send

from gateway.core.types import TenantPolicy
from gateway.errors import GatewayError
from gateway.state.errors import StateUnavailable

if TYPE_CHECKING:
    from gateway.runtime import Runtime
    from gateway.state.base import Lease


def error_response_parts(
    error: GatewayError, request_id: str
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    body = json.dumps(error.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", request_id.encode()),
    ]
    headers += [(k.encode(), v.encode()) for k, v in error.headers.items()]
    return error.status, headers, body


async def send_error(send: Send, error: GatewayError, request_id: str) -> None:
    status, headers, body = error_response_parts(error, request_id)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def sse_error_event(error: GatewayError) -> bytes:
    """An in-band error for a stream that already started: the official clients raise on it."""
    return b"data: " + json.dumps(error.body()).encode() + b"\n\n"


def duration(seconds: float) -> str:
    """OpenAI's reset format: `350ms`, `12s`, `1m5s`."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(round(seconds, 1), 60)
    text = f"{rest:g}s"
    return f"{int(minutes)}m{text}" if minutes else text


async def rate_limit_headers(
    runtime: Runtime, tenant: TenantPolicy, lease: Lease | None = None
) -> list[tuple[bytes, bytes]]:
    """`x-ratelimit-*` headers for a tenant with request or token limits; none otherwise.
    From the lease when its admission reported them, else asked of the store."""
    if tenant.rpm is None and tenant.tpm is None:
        return []
    state = lease.rates if lease is not None and lease.rates is not None else None
    if state is None:
        try:
            state = await runtime.store.rate_limits(tenant)
        except StateUnavailable:  # advisory headers: not worth failing the answer for
            return []
    out: list[tuple[bytes, bytes]] = []
    for kind, limit, remaining, reset in (
        ("requests", state.limit_requests, state.remaining_requests, state.reset_requests_s),
        ("tokens", state.limit_tokens, state.remaining_tokens, state.reset_tokens_s),
    ):
        if limit is None:
            continue
        out.append((f"x-ratelimit-limit-{kind}".encode(), str(limit).encode()))
        out.append((f"x-ratelimit-remaining-{kind}".encode(), str(remaining or 0).encode()))
        out.append((f"x-ratelimit-reset-{kind}".encode(), duration(reset or 0.0).encode()))
    return out
