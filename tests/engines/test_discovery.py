"""Discovery over real HTTP: a vLLM-shaped Starlette app served by uvicorn on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from gateway.engines.discovery import DiscoveredModel, DiscoveryError, discover
from gateway.harness import free_port
from tests.engines.pages import IDLE, SATURATED, add_dp_rank, capture, drop_series, set_label


def models_body(*models: dict[str, Any]) -> dict[str, Any]:
    return {"object": "list", "data": list(models)}


def vllm_model(model_id: str, max_model_len: int | None = 512) -> dict[str, Any]:
    """One `/v1/models` entry as vLLM 0.32 writes it (VLLM.md §4)."""
    entry: dict[str, Any] = {
        "id": model_id,
        "object": "model",
        "created": 1796020618,
        "owned_by": "vllm",
        "root": f"/models/{model_id}",
        "parent": None,
        "permission": [],
    }
    if max_model_len is not None:
        entry["max_model_len"] = max_model_len
    return entry


def vllm_app(
    models: Any = None,
    metrics: str | None = None,
    *,
    models_status: int = 200,
    metrics_status: int = 200,
) -> Starlette:
    models = models_body(vllm_model("tiny")) if models is None else models
    metrics = capture(IDLE) if metrics is None else metrics

    async def v1_models(request: Request) -> Response:
        if isinstance(models, str):
            return PlainTextResponse(models, status_code=models_status)
        return JSONResponse(models, status_code=models_status)

    async def prometheus(request: Request) -> Response:
        return PlainTextResponse(
            metrics, status_code=metrics_status, media_type="text/plain; version=0.0.4"
        )

    return Starlette(routes=[Route("/v1/models", v1_models), Route("/metrics", prometheus)])


@asynccontextmanager
async def serving(app: Starlette) -> AsyncIterator[str]:
    """Serve `app` with uvicorn on an ephemeral 127.0.0.1 port; yield its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="off", log_level="warning", ws="none")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(10):
            while not server.started:
                assert not task.done(), "uvicorn exited during start-up"
                await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()


async def discover_from(app: Starlette, suffix: str = "") -> tuple[str, Any]:
    async with serving(app) as url, httpx.AsyncClient(timeout=5) as client:
        return url, await discover(client, url + suffix)


# --- what is read -------------------------------------------------------------------------------


async def test_discovers_the_real_capture() -> None:
    url, engine = await discover_from(vllm_app())
    assert engine.base_url == url
    assert engine.models == (DiscoveredModel(id="tiny", max_model_len=512),)
    assert engine.model_ids == ("tiny",)
    assert engine.max_model_len == 512
    assert (engine.block_size, engine.num_gpu_blocks, engine.dp_size) == (128, 8192, 1)
    assert engine.cache is not None and engine.cache.kv_cache_size_tokens == 1_048_576
    assert dict(engine.sources) == {
        "models": "discovered:/v1/models",
        "max_model_len": "discovered:/v1/models",
        "num_gpu_blocks": "discovered:/metrics",
        "block_size": "discovered:/metrics",
        "dp_size": "discovered:/metrics",
        "prefix_caching": "discovered:/metrics",
    }
    assert engine.cache.enable_prefix_caching is True  # the capture's engine caches


async def test_trailing_slash_in_base_url() -> None:
    url, engine = await discover_from(vllm_app(metrics=capture(SATURATED)), suffix="/")
    assert engine.base_url == url
    assert (engine.block_size, engine.num_gpu_blocks) == (128, 6)


async def test_missing_max_model_len_is_accepted() -> None:
    _, engine = await discover_from(vllm_app(models_body(vllm_model("tiny", None))))
    assert engine.models == (DiscoveredModel(id="tiny", max_model_len=None),)
    assert engine.max_model_len is None
    assert "max_model_len" not in engine.sources


async def test_several_model_ids_take_the_smallest_max_model_len() -> None:
    body = models_body(vllm_model("base", 4096), vllm_model("lora-a", 2048), vllm_model("x", None))
    _, engine = await discover_from(vllm_app(body))
    assert engine.model_ids == ("base", "lora-a", "x")
    assert engine.max_model_len == 2048


async def test_metrics_without_cache_config_leave_geometry_unknown() -> None:
    page = drop_series(capture(IDLE), "vllm:cache_config_info")
    _, engine = await discover_from(vllm_app(metrics=page))
    assert (engine.block_size, engine.num_gpu_blocks, engine.dp_size) == (None, None, None)
    assert set(engine.sources) == {"models", "max_model_len"}


async def test_data_parallel_engine_reports_summed_blocks_and_its_size() -> None:
    page = add_dp_rank(capture(IDLE), "1")
    page = set_label(page, "vllm:cache_config_info", "num_gpu_blocks", "16384")
    _, engine = await discover_from(vllm_app(metrics=page))
    assert (engine.num_gpu_blocks, engine.dp_size) == (16384, 2)
    assert engine.cache is not None and engine.cache.num_gpu_blocks_per_rank == 8192


# --- failures -----------------------------------------------------------------------------------


async def test_engine_down() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with httpx.AsyncClient(timeout=5) as client:
        with pytest.raises(DiscoveryError) as caught:
            await discover(client, url)
    assert caught.value.url == f"{url}/v1/models"
    assert "request failed: ConnectError" in str(caught.value)
    assert isinstance(caught.value.__cause__, httpx.ConnectError)


@pytest.mark.parametrize(
    ("app", "path", "reason"),
    [
        (vllm_app(models_status=503, models="dead"), "/v1/models", "HTTP 503"),
        (vllm_app(models="<html>not json</html>"), "/v1/models", "not JSON"),
        (vllm_app(models={"object": "list"}), "/v1/models", "no `data` list"),
        (vllm_app(models=models_body({"object": "model"})), "/v1/models", "without a string `id`"),
        (vllm_app(models=models_body()), "/v1/models", "serves no model"),
        (
            vllm_app(models=models_body(vllm_model("tiny", "512"))),  # type: ignore[arg-type]
            "/v1/models",
            "bad max_model_len",
        ),
        (vllm_app(metrics_status=500), "/metrics", "HTTP 500"),
        (vllm_app(metrics="this is not prometheus"), "/metrics", "unreadable metrics page"),
    ],
)
async def test_bad_answers_raise_discovery_error(app: Starlette, path: str, reason: str) -> None:
    async with serving(app) as url, httpx.AsyncClient(timeout=5) as client:
        with pytest.raises(DiscoveryError, match=reason) as caught:
            await discover(client, url)
    assert caught.value.url == url + path
    assert str(caught.value).startswith(url + path)
