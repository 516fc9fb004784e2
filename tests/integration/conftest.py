"""Integration fixtures: simulated engines and the gateway on real loopback sockets, in this
test's event loop, with the official `openai` client as the client."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from gateway.config import parse_config
from gateway.embedded import running_app
from gateway.http.app import create_app
from gateway.http.listener import protocol_for
from gateway.runtime import Runtime, build_runtime
from gateway.sim.server import SimConfig
from gateway.sim.server import create_app as create_sim_app
from tests.admin import ADMIN_HEADERS, with_admin

FAST = SimConfig(
    served_model_name="tiny",
    block_size=16,
    max_model_len=1024,
    prefill_ms_per_token=0.001,
    decode_ms_base=1.0,
    decode_ms_per_seq=0.05,
)


@dataclasses.dataclass
class Engine:
    url: str
    app: Any

    @property
    def sim(self) -> Any:
        return self.app.state.sim


@dataclasses.dataclass
class Gateway:
    url: str
    runtime: Runtime
    engines: list[Engine]

    async def status(self) -> dict[str, Any]:
        async with httpx.AsyncClient() as client:
            return (await client.get(self.url + "/admin/status", headers=ADMIN_HEADERS)).json()

    async def reserved_blocks_settle(self, within_s: float = 2.0) -> list[int]:
        """Each engine's reserved blocks once all are 0, or as they stand after `within_s`
        (releases of abandoned requests land asynchronously)."""
        deadline = asyncio.get_running_loop().time() + within_s
        while True:
            reserved = [e["reserved_blocks"] for e in (await self.status())["engines"]]
            if not any(reserved) or asyncio.get_running_loop().time() > deadline:
                return reserved
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def gateway_over(
    sims: list[SimConfig],
    *,
    engine_settings: list[dict[str, Any]] | None = None,
    **overrides: Any,
) -> AsyncIterator[Gateway]:
    """A gateway over one simulated engine per config; `engine_settings[i]` adds keys to the
    i-th engine's entry, `overrides` replace top-level sections."""
    async with contextlib.AsyncExitStack() as stack:
        engines = []
        for i, sim in enumerate(sims):
            app = create_sim_app(dataclasses.replace(sim, seed=i))
            engines.append(Engine(await stack.enter_async_context(running_app(app)), app))
        raw: dict[str, Any] = {
            "engines": [
                {
                    "name": f"e{i}",
                    "url": e.url,
                    "max_num_seqs": sims[i].max_num_seqs,
                    **(engine_settings[i] if engine_settings else {}),
                }
                for i, e in enumerate(engines)
            ],
            "models": [{"name": "tiny", "tokenizer": "hf:@tiny"}],
            "routing": {"seed": 7},
        }
        for key, value in overrides.items():
            raw[key] = value
        cfg = parse_config(with_admin(raw))
        runtime = await build_runtime(cfg)
        listener = protocol_for(cfg.clients, runtime.metrics)
        url = await stack.enter_async_context(running_app(create_app(runtime), http=listener))
        yield Gateway(url, runtime, engines)


@pytest.fixture
def make_gateway() -> Callable[..., contextlib.AbstractAsyncContextManager[Gateway]]:
    return gateway_over
