"""The Starlette application: OpenAI routes, health, and an admin view of the gateway's state.

Each route is given what it reads (the pool, the store, the metrics) when the app is made
from a built `Runtime`; nothing looks the runtime up per request.

Who may read what: `/health` and `/ready` are open and name no engine (load balancers and
orchestrators probe them without credentials); `/v1/models` needs a tenant's key when tenants
are configured, as the completions do; `/admin/*` and `/metrics` pass the `AdminGate` (an
admin key, see `AdminConfig`). `/dashboard` is a page with no data of its own: it asks for
the admin key and polls `/admin/status` with it (`gateway/http/dashboard.py`).
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
from gateway.auth import default_policy, policy_of
from gateway.errors import GatewayError, ModelNotFound
from gateway.exchange import ROUTES
from gateway.http import dashboard
from gateway.http.completions import BodyLimits, CompletionsEndpoint
from gateway.http.errors import EngineNames, error_response_parts, log_error
from gateway.http.request_ids import request_id as request_id_of
from gateway.runtime import Runtime
from gateway.version import __version__

_STARTED = int(time.time())

Handler = Callable[[Request], Awaitable[Response]]


def status_extras(runtime: Runtime, worker: tuple[int, int] | None = None) -> status.Extras:
    """What `/admin/status` reads beyond the pool and the store: the configured tenants (as
    the last reload left them), the counters (every worker's), the estimates, the line."""
    service = runtime.service
    steered = service.adaptive if service.reservation == "adaptive" else {}
    models = {}
    for model, lengths in service.output_lengths.items():
        adaptive = steered.get(model)
        models[model] = status.ModelEstimate(
            predicted_output_tokens=lengths.predicted(),
            reserved_quantile=adaptive.quantile if adaptive is not None else None,
            reserved_margin=adaptive.margin if adaptive is not None else None,
        )
    slo = runtime.cfg.slo
    return status.Extras(
        tenants=[policy_of(t, slo) for t in runtime.cfg.tenants] or [default_policy(slo)],
        totals=runtime.metrics.totals(),
        models=models,
        oldest_wait_s=runtime.scheduler.oldest_wait_s(),
        worker=worker,
        service_classes=[slo.service_class(name) for name in slo.classes],
        default_class=slo.default_class,
        class_header=slo.header,
        stored_responses=(len(service.responses), service.responses.max_entries),
    )


def _routes(runtime: Runtime, worker: tuple[int, int] | None = None) -> list[Route]:
    pool, store, metrics = runtime.pool, runtime.store, runtime.metrics
    kv_ceiling = runtime.cfg.admission.kv_ceiling
    auth, admin = runtime.auth, runtime.admin

    def for_admins(handler: Handler) -> Handler:
        async def checked(request: Request) -> Response:
            admin.check(request.headers.get("authorization"))
            return await handler(request)

        return checked

    def model_card(name: str, max_len: int) -> dict[str, object]:
        return {
            "id": name,
            "object": "model",
            "created": _STARTED,
            "owned_by": "kv-gateway",
            "root": name,
            "parent": None,
            "max_model_len": max_len,
        }

    async def list_models(request: Request) -> Response:
        auth.tenant(request.headers.get("authorization"))
        data = [model_card(name, n) for name, n in sorted(pool.models().items())]
        return JSONResponse({"object": "list", "data": data})

    async def get_model(request: Request) -> Response:
        """`GET /v1/models/{id}` (the SDK's `models.retrieve`), answered from what the
        engines serve; an unknown id is OpenAI's 404 `model_not_found`."""
        auth.tenant(request.headers.get("authorization"))
        name = request.path_params["model_id"]
        served = pool.models()
        if name not in served:
            shown = name if len(name) <= 200 else name[:200] + "…"
            raise ModelNotFound(f"The model `{shown}` does not exist.", param="model")
        return JSONResponse(model_card(name, served[name]))

    async def version(request: Request) -> Response:
        """`GET /version`: the gateway's own version (vLLM answers its own there)."""
        auth.tenant(request.headers.get("authorization"))
        return JSONResponse({"version": __version__, "server": "kv-gateway"})

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
        steered = service.adaptive if service.reservation == "adaptive" else None
        page = await metrics.render(store, pool, service.output_lengths, kv_ceiling, steered)
        return Response(page, media_type=CONTENT_TYPE_LATEST)

    async def admin_status(request: Request) -> Response:
        """What the gateway believes (`docs/status.schema.json`): engines (with where each
        value came from), loads, the queue, traffic, tenants, estimates. The dashboard's JSON."""
        extras = status_extras(runtime, worker)
        prefixes = runtime.service.prefixes
        document = await status.snapshot(
            store,
            pool,
            kv_ceiling,
            extras,
            prefix_index=prefixes.status if prefixes else None,
        )
        return JSONResponse(document, headers={"cache-control": "no-store"})

    get: list[tuple[str, Handler]] = [
        ("/v1/models", list_models),
        ("/v1/models/{model_id:path}", get_model),
        ("/version", version),
        ("/health", health),
        ("/ready", ready),
        ("/metrics", for_admins(metrics_page)),
        ("/admin/status", for_admins(admin_status)),
        *dashboard.pages(),
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


def create_app(runtime: Runtime, worker: tuple[int, int] | None = None) -> GatewayApp:
    """The gateway app over a built `runtime` (engines discovered: start-up errors come
    before binding); the app's lifespan closes the runtime at shutdown. `worker`: (index,
    count) when this process is one of `serve --workers N` (`/admin/status` says so)."""

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
        path: CompletionsEndpoint(kind, runtime.exchanges, runtime.auth, limits, names, path)
        for path, kind in ROUTES.items()
    }
    routes = [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in hot.items()),
        *_routes(runtime, worker),
    ]
    starlette = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error, GatewayError: gateway_error},
    )
    return GatewayApp(starlette, hot)
