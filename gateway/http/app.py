"""The Starlette application: OpenAI routes, health, and an admin view of the gateway's state.

Each route is given what it reads (the pool, the store, the metrics) when the app is made
from a built `Runtime`; nothing looks the runtime up per request.

Who may read what: `/health` and `/ready` are open and name no engine (load balancers and
orchestrators probe them without credentials); `/v1/models` needs a tenant's key when tenants
are configured, as the completions do; `/admin/*` and `/metrics` pass the `AdminGate` (an
admin key, see `AdminConfig`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway import status
from gateway.errors import GatewayError
from gateway.exchange import PATHS
from gateway.http.completions import BodyLimits, CompletionsEndpoint
from gateway.http.errors import EngineNames, error_response_parts, log_error
from gateway.http.request_ids import request_id as request_id_of
from gateway.runtime import Runtime

_STARTED = int(time.time())

Handler = Callable[[Request], Awaitable[Response]]


def _routes(runtime: Runtime) -> list[Route]:
    pool, store, metrics = runtime.pool, runtime.store, runtime.metrics
    kv_ceiling = runtime.cfg.admission.kv_ceiling
    auth, admin = runtime.auth, runtime.admin

    def for_admins(handler: Handler) -> Handler:
        async def checked(request: Request) -> Response:
            admin.check(request.headers.get("authorization"))
            return await handler(request)

        return checked

    async def list_models(request: Request) -> Response:
        auth.tenant(request.headers.get("authorization"))
        data = [
            {
                "id": name,
                "object": "model",
                "created": _STARTED,
                "owned_by": "kv-gateway",
                "root": name,
                "parent": None,
                "max_model_len": max_len,
            }
            for name, max_len in sorted(pool.models().items())
        ]
        return JSONResponse({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        """Ready when every served model has at least one healthy engine. Open to anyone:
        counts only, no engine names or addresses."""
        models = {
            m: {
                "healthy_engines": sum(e.healthy for e in pool.serving(m)),
                "engines": len(pool.serving(m)),
            }
            for m in pool.models()
        }
        missing = sorted(m for m, counts in models.items() if not counts["healthy_engines"])
        body = {
            "status": "not ready" if missing else "ready",
            "models": models,
            "unserved": missing,
        }
        return JSONResponse(body, status_code=503 if missing else 200)

    async def metrics_page(request: Request) -> Response:
        service = runtime.service
        quantiles = None
        if service.reservation == "adaptive":
            quantiles = {model: a.quantile for model, a in service.adaptive.items()}
        page = await metrics.render(store, pool, service.output_lengths, kv_ceiling, quantiles)
        return Response(page, media_type=CONTENT_TYPE_LATEST)

    async def admin_status(request: Request) -> Response:
        """What the gateway believes: engines (with where each value came from), loads, queue."""
        return JSONResponse(await status.snapshot(store, pool, kv_ceiling))

    get: list[tuple[str, Handler]] = [
        ("/v1/models", list_models),
        ("/health", health),
        ("/ready", ready),
        ("/metrics", for_admins(metrics_page)),
        ("/admin/status", for_admins(admin_status)),
    ]
    return [Route(path, handler, methods=["GET"]) for path, handler in get]


async def gateway_error(request: Request, exc: Exception) -> Response:
    """The gateway's own errors outside the completions path (e.g. Redis unreachable while
    `/admin/status` reads it) in the OpenAI shape, with their status."""
    assert isinstance(exc, GatewayError)
    request_id = request_id_of(request.scope)
    log_error(exc, request_id)
    status, headers, body = error_response_parts(exc, request_id)
    return Response(body, status_code=status, headers={k.decode(): v.decode() for k, v in headers})


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (unknown route, wrong method) in the OpenAI shape too."""
    assert isinstance(exc, HTTPException)
    error = GatewayError(
        f"{exc.detail}: {request.method} {request.url.path}", code=f"http_{exc.status_code}"
    )
    error.type = "invalid_request_error"
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


class GatewayApp:
    """The completions paths go straight to their endpoint — the hot path skips Starlette's
    routing and middleware; everything else (lifespan included) goes to Starlette."""

    def __init__(self, starlette: Starlette, hot: dict[str, CompletionsEndpoint]) -> None:
        self.starlette = starlette
        self.hot = hot

    @property
    def state(self) -> State:
        return self.starlette.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.hot.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self.starlette
                await endpoint(scope, receive, send)
                return
        await self.starlette(scope, receive, send)


def create_app(runtime: Runtime) -> GatewayApp:
    """The gateway app over a built `runtime` (engines discovered: start-up errors come
    before binding); the app's lifespan closes the runtime at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await runtime.aclose()

    limits = BodyLimits(
        max_bytes=runtime.cfg.upstream.max_body_bytes,
        max_json_depth=runtime.cfg.clients.max_json_depth,
    )
    names = EngineNames.of(runtime.cfg.engines)
    hot = {
        path: CompletionsEndpoint(kind, runtime.exchanges, runtime.auth, limits, names)
        for kind, path in PATHS.items()
    }
    routes = [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in hot.items()),
        *_routes(runtime),
    ]
    starlette = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error, GatewayError: gateway_error},
    )
    return GatewayApp(starlette, hot)
