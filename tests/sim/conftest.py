"""Simulated engines over real HTTP (uvicorn on 127.0.0.1, an ephemeral port)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.embedded import running_sim
from gateway.sim.server import SimConfig

# Small, fast engines; tests that need slower steps say so.
FAST = dict(prefill_ms_per_token=0.0, decode_ms_base=1.0, decode_ms_per_seq=0.0)

SimFactory = Callable[..., AbstractAsyncContextManager[str]]


@pytest.fixture
def sim() -> SimFactory:
    """``async with sim(num_gpu_blocks=..., ...) as url``: one engine for this test."""

    def start(**overrides: Any) -> AbstractAsyncContextManager[str]:
        return running_sim(SimConfig(**{**FAST, **overrides}))

    return start


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as c:
        yield c


async def metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """``{sample name + sorted non-engine/model labels: value}`` of an engine's /metrics."""
    page = (await client.get(f"{url}/metrics")).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            extra = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("engine", "model_name")
            )
            out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return out


async def state(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    body: dict[str, Any] = (await client.get(f"{url}/sim/state")).json()
    return body


async def wait_idle(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    """Poll /sim/state until no request is left (at most 5 s); return that state."""
    async with asyncio.timeout(5):
        while True:
            st = await state(client, url)
            if st["running"] == 0 and st["waiting"] == 0:
                return st
            await asyncio.sleep(0.01)


def blocks(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)
