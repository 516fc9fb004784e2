"""A hand-scripted engine (real HTTP, loopback) and the gateway in front of it, for tests of
misbehaviour the simulator does not do: silences, stalls, 500s, slow probes.

`engine_app(completions, health=...)` serves `/v1/completions` with the given handler, `/health`
(200 unless `health` says otherwise) and an empty `/metrics`; `gateway_in_front(app, **raw)`
runs it and one gateway whose only engine it is (every geometry value configured), `raw`
overriding or adding config sections.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.config import parse_config
from gateway.embedded import running_app
from gateway.http.app import create_app
from gateway.runtime import build_runtime
from tests.admin import with_admin

Handler = Callable[[Request], Awaitable[Response]]


async def _ok(request: Request) -> Response:
    return Response()


async def _no_metrics(request: Request) -> Response:
    return Response("", media_type="text/plain")


def engine_app(completions: Handler, *, health: Handler = _ok) -> Starlette:
    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/health", health),
            Route("/metrics", _no_metrics),
        ]
    )


@contextlib.asynccontextmanager
async def gateway_in_front(app: Starlette, **raw: Any) -> AsyncIterator[str]:
    """The gateway's base URL, in front of `app` (served on loopback meanwhile)."""
    async with running_app(app) as engine:
        geometry = {"num_gpu_blocks": 65, "block_size": 16, "max_num_seqs": 8}
        cfg = parse_config(
            with_admin(
                {
                    "engines": [
                        {"name": "scripted", "url": engine, "models": ["tiny"]}
                        | {"max_model_len": 512}
                        | geometry
                    ],
                    "models": [{"name": "tiny", "tokenizer": "hf:@tiny"}],
                    **raw,
                }
            )
        )
        runtime = await build_runtime(cfg)
        async with running_app(create_app(runtime)) as url:
            yield url


def tenant_with_key(name: str, **limits: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """A tenant's config entry and the headers that authenticate as it."""
    key = f"key-{name}"
    entry = {"name": name, "api_keys": [hashlib.sha256(key.encode()).hexdigest()], **limits}
    return entry, {"authorization": f"Bearer {key}"}
