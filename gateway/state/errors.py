"""Errors of the state stores."""

from __future__ import annotations

from gateway.errors import GatewayError


class StateUnavailable(GatewayError):
    """503: the shared state (Redis) cannot be reached and the store fails closed.

    Raised by `RedisStore` with `on_failure="fail_closed"`; a `GatewayError`, so the HTTP
    layer renders it as an OpenAI-shaped 503 without further mapping."""

    status = 503
    type = "service_unavailable"
    code = "state_unavailable"
