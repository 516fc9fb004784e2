"""ASGI apps served inside the current event loop, on loopback ports.

Used by `kv-gateway demo` (two simulated engines and the gateway in one process) and by the
integration tests. Several servers share one process, so none of them takes over signals:
the owner decides when they stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Generator

import uvicorn
from starlette.types import ASGIApp


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves SIGINT/SIGTERM to whoever runs it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


@contextlib.asynccontextmanager
async def running_app(
    app: ASGIApp,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
    http: type[asyncio.Protocol] | str = "auto",
) -> AsyncIterator[str]:
    """Serve `app` on `host:port` (0: a free port) until the block exits; yields its base URL.
    `http`: uvicorn's HTTP protocol (the gateway's is `gateway.http.listener.protocol_for`).

    The app's lifespan runs: a start-up failure is raised here.
    """
    # proto must be IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only then, and
    # without it Nagle + delayed ACK add ~40 ms to every response on loopback.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    bound = sock.getsockname()[1]
    server = EmbeddedServer(
        uvicorn.Config(app, log_level=log_level, lifespan="on", access_log=False, http=http)
    )
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"embedded:{bound}")
    try:
        while not server.started:
            if task.done():
                task.result()  # re-raises the start-up error
                raise RuntimeError(f"server on port {bound} stopped during start-up")
            await asyncio.sleep(0.01)
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=10)
        except TimeoutError:
            server.force_exit = True
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(task, timeout=5)
        finally:
            sock.close()
