"""Simulated engines inside the current event loop, on ephemeral loopback ports.

For ``kv-gateway demo`` and for tests: ``async with running_sim(cfg) as base_url`` starts a
uvicorn server on ``cfg.host`` (an ephemeral port), waits
until it serves, yields ``http://127.0.0.1:<port>`` and stops it cleanly on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator, Sequence

import uvicorn

from gateway.sim.server import SimConfig, create_app


@contextlib.asynccontextmanager
async def running_sim(cfg: SimConfig, *, port: int = 0) -> AsyncIterator[str]:
    """Serve one simulated engine on ``cfg.host`` at ``port`` (0 = a free ephemeral port).

    ``cfg.port`` is ignored: in-process engines are for tests and the demo, which must not
    collide. Yields the base URL (no trailing slash, no ``/v1``).
    """
    # proto must be IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only then, and
    # without it Nagle + delayed ACK add ~40 ms to every response on loopback.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, port))
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(
        create_app(dataclasses.replace(cfg, port=bound_port)),
        log_level="warning",
        lifespan="on",
        access_log=False,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"sim:{bound_port}")
    try:
        while not server.started:
            if task.done():
                task.result()  # raises the start-up error
                raise RuntimeError("simulated engine stopped during start-up")
            await asyncio.sleep(0.01)
        yield f"http://{cfg.host}:{bound_port}"
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(task, timeout=5)
        except TimeoutError:
            server.force_exit = True
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        sock.close()


@contextlib.asynccontextmanager
async def serve_sims(configs: Sequence[SimConfig]) -> AsyncIterator[list[str]]:
    """Several engines at once; yields their base URLs in the order of ``configs``."""
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(running_sim(cfg)) for cfg in configs]
        yield urls
