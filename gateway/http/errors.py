"""The one place that renders errors for clients: OpenAI-shaped JSON, or an SSE event once a
stream has started. Never a stack trace."""

from __future__ import annotations

import json

from starlette.types import Send

from gateway.core.tenants import RateLimitValues
from gateway.errors import GatewayError


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


def rate_limit_headers(state: RateLimitValues | None) -> list[tuple[bytes, bytes]]:
    """`x-ratelimit-*` headers for the limits a tenant has (none when `state` is None)."""
    if state is None:
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
