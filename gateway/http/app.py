"""The Starlette application: OpenAI routes, health, and an admin view of the gateway's state."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.config import GatewayConfig
from gateway.errors import GatewayError
from gateway.http.completions import CompletionsEndpoint
from gateway.runtime import Runtime, build_runtime

_STARTED = int(time.time())


def _runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


async def list_models(request: Request) -> Response:
    models = _runtime(request).pool.models()
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
        for name, max_len in sorted(models.items())
    ]
    return JSONResponse({"object": "list", "data": data})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """Ready when every served model has at least one healthy engine."""
    runtime = _runtime(request)
    models = {
        m: [e.spec.name for e in runtime.pool.serving(m) if e.healthy]
        for m in runtime.pool.models()
    }
    missing = sorted(m for m, engines in models.items() if not engines)
    body = {"status": "not ready" if missing else "ready", "models": models, "unserved": missing}
    return JSONResponse(body, status_code=503 if missing else 200)


async def metrics(request: Request) -> Response:
    runtime = _runtime(request)
    return Response(await runtime.metrics.render(runtime), media_type=CONTENT_TYPE_LATEST)


async def status(request: Request) -> Response:
    """What the gateway believes: engines (with where each value came from), loads, queue."""
    runtime = _runtime(request)
    loads = await runtime.store.loads()
    engines = []
    for state in runtime.pool:
        spec = state.spec
        load = loads.get(spec.name)
        engines.append(
            {
                "name": spec.name,
                "url": spec.url,
                "models": sorted(spec.models),
                "healthy": state.healthy,
                "last_error": state.last_error,
                "reported": {
                    "used_blocks": state.used_blocks,
                    "running": state.running,
                    "waiting": state.waiting,
                    "kv_cache_usage": state.kv_cache_usage,
                    "num_preemptions": state.preemptions,
                    "age_s": None
                    if state.last_scrape is None
                    else round(time.monotonic() - state.last_scrape, 3),
                },
                "num_gpu_blocks": spec.num_gpu_blocks,
                "block_size": spec.block_size,
                "max_num_seqs": spec.max_num_seqs,
                "max_model_len": spec.max_model_len,
                "capacity_blocks": spec.capacity_blocks(runtime.cfg.admission.kv_ceiling),
                "reserved_blocks": load.reserved_blocks if load else 0,
                "reserved_seqs": load.reserved_seqs if load else 0,
                "sources": state.sources,
            }
        )
    return JSONResponse(
        {"engines": engines, "queue": {"length": await runtime.store.queue_length()}}
    )


async def gateway_error(request: Request, exc: Exception) -> Response:
    """The gateway's own errors outside the completions path (e.g. Redis unreachable while
    `/admin/status` reads it) in the OpenAI shape, with their status."""
    assert isinstance(exc, GatewayError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


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


def create_app(cfg: GatewayConfig, runtime: Runtime | None = None) -> GatewayApp:
    """The gateway app. Pass a `runtime` already built (engines discovered) to start faster and
    report start-up errors before binding; otherwise it is built in the lifespan."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.runtime = runtime or await build_runtime(cfg)
        try:
            yield
        finally:
            await app.state.runtime.aclose()

    hot = {
        "/v1/chat/completions": CompletionsEndpoint("chat"),
        "/v1/completions": CompletionsEndpoint("completion"),
    }
    routes = [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in hot.items()),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/admin/status", status, methods=["GET"]),
    ]
    starlette = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error, GatewayError: gateway_error},
    )
    return GatewayApp(starlette, hot)
