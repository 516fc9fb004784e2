"""The one place that renders errors for clients: OpenAI-shaped JSON, or an SSE event once a
stream has started. Never a stack trace.

What a client reads is public: the gateway's own failures (5xx) say what happened in a fixed
sentence with the request id, because their detail names internal addresses, engines and
library errors (`Error 111 connecting to 127.0.0.1:6379`, `the engine at http://10.0.0.7:8000
sent nothing for 120 s`). The detail goes to the log, once, with the same request id
(`log_error`). Client errors (4xx) are about the request and are shown as they are.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus

from starlette.types import Send

from gateway.config import EngineConfig
from gateway.core.tenants import RateLimitValues
from gateway.errors import GatewayError

log = logging.getLogger(__name__)

PUBLIC_MESSAGES = {
    "upstream_unavailable": "The engine could not serve this request.",
    "upstream_timeout": "The engine did not answer in time.",
    "no_healthy_engine": "No healthy engine can serve this request now.",
    "state_unavailable": "The gateway's shared state is unreachable; retrying shortly.",
}
"""What a client is told for each of the gateway's own 5xx codes; any other 5xx code:
`PUBLIC_FALLBACK`."""
PUBLIC_FALLBACK = "The gateway could not serve this request."


@dataclass(frozen=True)
class EngineNames:
    """What clients may read of engine names. An engine configured without a `name` is
    named by its `host:port`: such names are replaced by an alias (`#1`, `#2`, … in config
    order) in the messages clients read, and never sent as `x-kv-gateway-engine`."""

    shown: frozenset[str] = frozenset()
    aliases: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, engines: Sequence[EngineConfig]) -> EngineNames:
        unnamed = [e.display_name for e in engines if e.name is None]
        return cls(
            shown=frozenset(e.name for e in engines if e.name is not None),
            aliases={name: f"#{i}" for i, name in enumerate(unnamed, 1)},
        )

    def scrub(self, text: str) -> str:
        for name, alias in self.aliases.items():
            text = text.replace(name, alias)
        return text


NO_NAMES = EngineNames()


def public_body(
    error: GatewayError, request_id: str, names: EngineNames = NO_NAMES
) -> dict[str, object]:
    """`error` as the client may see it (see the module docstring)."""
    body = error.body()
    inner = body["error"]
    assert isinstance(inner, dict)
    if error.status >= 500:
        text = PUBLIC_MESSAGES.get(error.code or "", PUBLIC_FALLBACK)
        inner["message"] = f"{text} (request id {request_id}; details in the gateway's log)"
    else:  # e.g. "engine '10.0.0.7:8000' admits at most 120 blocks" (a 400)
        inner["message"] = names.scrub(error.message)
    return body


def log_error(error: GatewayError, request_id: str) -> None:
    """The one log line of a failed request: the gateway's own failures at warning, with
    the detail the client does not see; refusals and bad requests at debug."""
    level = logging.WARNING if error.status >= 500 else logging.DEBUG
    log.log(level, "request %s: %d %s: %s", request_id, error.status, error.code, error.message)


def error_response_parts(
    error: GatewayError, request_id: str, names: EngineNames = NO_NAMES
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    body = json.dumps(public_body(error, request_id, names)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", request_id.encode()),
    ]
    headers += [(k.encode(), v.encode()) for k, v in error.headers.items()]
    return error.status, headers, body


def raw_response(error: GatewayError, request_id: str) -> bytes:
    """`error` as a whole HTTP/1.1 response that closes the connection, for answers the
    server writes itself, before or instead of the app (a connection over a cap, a client
    too slow to send its request)."""
    status, headers, body = error_response_parts(error, request_id)
    reason = HTTPStatus(status).phrase.encode()
    lines = [b"HTTP/1.1 %d %s" % (status, reason), *(k + b": " + v for k, v in headers)]
    return b"\r\n".join([*lines, b"connection: close", b"", body])


async def send_error(
    send: Send, error: GatewayError, request_id: str, names: EngineNames = NO_NAMES
) -> None:
    status, headers, body = error_response_parts(error, request_id, names)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def sse_error_event(error: GatewayError, request_id: str) -> bytes:
    """An in-band error for a stream that already started: the official clients raise on it."""
    return b"data: " + json.dumps(public_body(error, request_id)).encode() + b"\n\n"


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
