"""The Redis store's Lua scripts, called the cheap way: one FCALL (or EVALSHA) per call.

redis-py's asyncio client packs every command in Python, argument by argument, and runs it
through several layers of wrappers (retry, script registration, response callbacks): with
some thirty arguments per admission that was about half of the gateway's CPU time per
request on the Redis path (measured with cProfile, docs/benchmarks.md). Here a script call
is packed by hiredis's C packer (hiredis is a dependency: redis-py parses with it too), with the
keys and the arguments every call shares packed into the same command, sent on a
connection of a `Lane` (a bounded set of the store's own connections, without redis-py's
pool and its per-call bookkeeping, which cost another ~30 µs per call), and its one reply
read back.

The scripts are one Redis function library (`Library`, Redis 7.0 and later): loaded once, so
the ~700 lines every script shares (common.lua) are defined once, not on each call (that was
about 45 µs of each call's ~200-380 µs of server time on the 2-core machine:
docs/benchmarks.md). A server that does not know the library (a fresh or restarted Redis:
`Function not found`) is sent it and the call made again; a server without functions (Redis
before 7.0: `unknown command`), or one that does not let this user load or call them
(renamed commands, an ACL: `NOPERM`), is called with EVALSHA from then on, each script with
the shared code prepended (the SHA computed once; `NOSCRIPT` loads the script and runs it again).

Contract: `Script.__call__` either returns the script's reply or raises redis-py's errors —
`ConnectionError` / `TimeoutError` / `OSError` for a lost Redis (after one immediate retry
on a fresh connection: every script is safe to run twice), `ResponseError` for an error the
script raised. A connection whose call did not end cleanly is dropped, never reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import hiredis
from redis.asyncio.connection import AbstractConnection as Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError


def _pack(args: Sequence[str | int]) -> list[bytes]:
    return [hiredis.pack_command(tuple(args))]  # type: ignore[arg-type]


class Lane:
    """A bounded set of connections for script calls: at most `size` at once, each used by
    one call at a time; a call beyond that waits for its turn (back-pressure, not an
    error). A connection a call left in doubt (lost, timed out, cancelled) is dropped and
    replaced by a fresh one on demand. `on_turn` runs when a call's turn comes, before it
    takes a connection: it may raise to fail the call at once (e.g. Redis known to be away
    while the call waited)."""

    def __init__(
        self,
        factory: Callable[[], Connection],
        size: int,
        on_turn: Callable[[], None] | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("a lane needs at least one connection")
        self.size = size
        self._factory = factory
        self._on_turn = on_turn
        self._idle: list[Connection] = []
        self._turns = asyncio.Semaphore(size)
        self.open = 0  # connections made and not dropped: at most `size`

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Connection]:
        async with self._turns:
            if self._on_turn is not None:
                self._on_turn()
            if self._idle:
                conn = self._idle.pop()
            else:
                conn = self._factory()
                self.open += 1
            clean = False
            try:
                if not conn.is_connected:
                    await conn.connect()  # type: ignore[no-untyped-call]
                yield conn
                clean = True
            finally:
                if clean:
                    self._idle.append(conn)
                else:
                    self.open -= 1
                    await conn.disconnect(nowait=True)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.disconnect(nowait=True)


def _no_function(error: ResponseError) -> bool:
    """Whether an error says the server cannot run the library: it does not have it
    (`Function not found`), has no such command (Redis before 7.0, or renamed away), or does
    not let this user run it (`NOPERM`)."""
    text = str(error)
    return text.startswith(("Function not found", "unknown command")) or isinstance(
        error, NoPermissionError
    )


class Library:
    """The scripts as one Redis function library: `source` (FUNCTION LOAD's text, its name in
    its first line) and whether the server takes FCALL (`functions`; False once a server
    said it cannot run the library, then every script goes by EVALSHA)."""

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = source
        self.functions = True

    @staticmethod
    def function_name(library: str, script: str) -> str:
        """The function of `script` in the library named `library`."""
        return f"{library}_{script}"


class Script:
    """One Lua script of a store, `name`: `await script(lane, args)` runs it with the store's
    keys and the leading arguments every call shares (`shared`), then `args`: by FCALL of
    its function in `library` when there is one and the server runs it, else by EVALSHA of
    `source` (the script whole, shared code included)."""

    def __init__(
        self,
        name: str,
        source: str,
        keys: Sequence[str],
        shared: Sequence[str],
        library: Library | None = None,
    ) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        self._head: tuple[str | int, ...] = ("EVALSHA", self.sha, len(keys), *keys, *shared)
        self._library = library
        function = Library.function_name(library.name, name) if library else ""
        self._fcall: tuple[str | int, ...] = ("FCALL", function, len(keys), *keys, *shared)

    async def __call__(self, lane: Lane, args: Sequence[str]) -> Any:
        try:
            return await self._send(lane, args)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            # A kept connection may have died with an earlier server: once more, afresh.
            return await self._send(lane, args)

    async def _send(self, lane: Lane, args: Sequence[str]) -> Any:
        library = self._library
        async with lane.connection() as conn:
            if library is not None and library.functions:
                packed = _pack((*self._fcall, *args))
                try:
                    return await _run(conn, packed)
                except ResponseError as e:
                    if not _no_function(e):
                        raise  # the script's own error
                    # A fresh or restarted Redis lacks the library: send it, call again.
                    missing = str(e).startswith("Function not found")
                    if missing and await _load(conn, library):
                        return await _run(conn, packed)
                    # Redis before 7.0, or FCALL / FUNCTION not allowed: EVALSHA from now on.
                    library.functions = False
            packed = _pack((*self._head, *args))
            try:
                return await _run(conn, packed)
            except NoScriptError:  # a Redis that restarted: load it, run it again
                await conn.send_command("SCRIPT", "LOAD", self.source)
                await conn.read_response()
                return await _run(conn, packed)


async def _run(conn: Connection, packed: list[bytes]) -> Any:
    """Send one packed command on `conn` and read its reply."""
    await conn.send_packed_command(packed, check_health=False)
    return await conn.read_response()


async def _load(conn: Connection, library: Library) -> bool:
    """FUNCTION LOAD the library; False when the server will not (see `_no_function`)."""
    await conn.send_command("FUNCTION", "LOAD", "REPLACE", library.source)
    try:
        await conn.read_response()
    except ResponseError as e:
        if not _no_function(e):
            raise
        return False
    return True
