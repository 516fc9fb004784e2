"""A TCP forwarder to Redis that a test can cut and restore: Redis lost and back, without
touching the session's server.

Also a bare relay in a process of its own, the control for what any hop between a client and
an engine costs (tests/e2e/test_parity.py): `python -m tests.state.tcp_proxy HOST PORT
LISTEN_PORT` forwards bytes, reads nothing, decides nothing, until killed."""

from __future__ import annotations

import asyncio
import contextlib

from tests.redis_server import redis_address


class TcpProxy:
    def __init__(self, target: tuple[str, int] | None = None) -> None:
        """Forwards to `target` (host, port); by default the test session's Redis."""
        self.target = target or redis_address()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self._stopped = False
        self._server = await asyncio.start_server(
            self._accept, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Refuse new connections and cut every open one."""
        self._stopped = True
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.close()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        for writer in list(self._writers):
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        upstream_writer = None
        try:
            # A connection accepted just before `stop` whose handler runs after it (or
            # while it opens its upstream) is cut too, not left forwarding.
            if self._stopped:
                return
            up_reader, upstream_writer = await asyncio.open_connection(*self.target)
            self._writers.add(upstream_writer)
            if self._stopped:
                return
            await asyncio.gather(self._pipe(reader, upstream_writer), self._pipe(up_reader, writer))
        finally:
            self._tasks.discard(task)
            for w in (writer, upstream_writer):
                if w is not None:
                    w.close()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()


async def _relay_forever(host: str, port: int, listen: int) -> None:
    proxy = TcpProxy((host, port))
    proxy.port = listen
    await proxy.start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    import sys

    asyncio.run(_relay_forever(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
