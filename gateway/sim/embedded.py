"""Simulated engines inside the current event loop, on ephemeral loopback ports.

For tests and `kv-gateway demo`: ``async with running_sim(cfg) as base_url`` serves one
engine (through `gateway.embedded.running_app`) and stops it cleanly on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from gateway.embedded import running_app
from gateway.sim.server import SimConfig, create_app


@contextlib.asynccontextmanager
async def running_sim(cfg: SimConfig, *, port: int = 0) -> AsyncIterator[str]:
    """Serve one simulated engine on ``cfg.host`` at ``port`` (0 = a free ephemeral port).

    ``cfg.port`` is ignored: in-process engines are for tests and the demo, which must not
    collide. Yields the base URL (no trailing slash, no ``/v1``).
    """
    async with running_app(create_app(cfg), host=cfg.host, port=port) as url:
        yield url
