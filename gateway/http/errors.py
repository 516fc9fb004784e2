"""The one place that renders errors for clients: OpenAI-shaped JSON, or an SSE event once a
stream has started. Never a stack trace."""

from __future__ import annotations

import json

from starlette.types import Send

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
