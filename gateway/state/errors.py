"""Errors of the state stores."""

from __future__ import annotations

from gateway.core.retry import RetryAdvice
from gateway.errors import GatewayError


class StateUnavailable(GatewayError):
    """503: the shared state (Redis) cannot be reached and the store fails closed.

    Raised by `RedisStore` with `on_failure="fail_closed"`; a `GatewayError`, so the HTTP
    layer renders it as an OpenAI-shaped 503 without further mapping. `retry_after_s`: when
    the store will try Redis again (`Retry-After`, whole seconds and at least 1, and
    `retry-after-ms`, as the 429s give them), so clients that honour it come back then."""

    status = 503
    type = "service_unavailable"
    code = "state_unavailable"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        retry = RetryAdvice(max(0.0, retry_after_s))
        super().__init__(
            message,
            headers={
                "retry-after": str(retry.header_seconds),
                "retry-after-ms": str(retry.header_ms),
            },
        )
