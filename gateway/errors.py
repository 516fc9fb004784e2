"""The one error tree. Every failure a client can see is a `GatewayError`; `http/` renders it
as OpenAI-shaped JSON `{"error": {"message", "type", "param", "code"}}` with its headers."""

from __future__ import annotations

from gateway.core.retry import RetryAdvice


class GatewayError(Exception):
    status = 500
    type = "internal_error"
    code: str | None = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ContextOverflow(BadRequest):
    """The request can never fit: longer than max_model_len or than any engine's KV."""

    code = "context_length_exceeded"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class Unauthorized(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class EndpointNotServed(GatewayError):
    """404: the engines serving the model do not serve this endpoint (vLLM serves
    embeddings, score and rerank only for pooling models, for instance)."""

    status = 404
    type = "invalid_request_error"
    code = "endpoint_not_served"


class RateLimited(GatewayError):
    """429: the gateway will not take this request now; `Retry-After` says when to try."""

    status = 429
    type = "rate_limit_exceeded"

    def __init__(self, message: str, *, code: str, retry: RetryAdvice) -> None:
        super().__init__(
            message,
            code=code,
            headers={
                "retry-after": str(retry.header_seconds),
                "retry-after-ms": str(retry.header_ms),
            },
        )
        self.retry = retry


class UpstreamUnavailable(GatewayError):
    """502: the engine could not be reached or failed."""

    status = 502
    type = "upstream_error"
    code = "upstream_unavailable"


class NoEngine(GatewayError):
    """503: no engine can serve the model right now."""

    status = 503
    type = "service_unavailable"
    code = "no_healthy_engine"


class UpstreamTimeout(GatewayError):
    status = 504
    type = "upstream_error"
    code = "upstream_timeout"
