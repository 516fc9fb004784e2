"""The Redis store's Lua scripts, called the cheap way: one FCALL (or EVALSHA) per call.

redis-py's asyncio client packs every command in Python, argument by argument, and runs it
through several layers of wrappers (retry, script registration, response callbacks): with
some thirty arguments per admission that was about half of the gateway's CPU time per
request on the Redis path (measured with cProfile, docs/benchmarks.md). Here a script call
is packed by hiredis's C packer (hiredis is a dependency: redis-py parses with it too), with the
keys and the arguments every call shares packed into the same command, and sent on a
`Lane`: one connection of the store's own, pipelined (calls in flight at once are written as
they come and their replies read in order by one reader task), without redis-py's pool and
its per-call timers and bookkeeping. A call through redis-py's connection one at a time —
a pooled connection each, a timed write that starts a task, a timed read — cost the client
35-45 % more CPU than a pipelined one (admit + release pairs, 16 at a time: 339-372 against
189-242 µs per pair on the 2-core machine, docs/benchmarks.md).

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
script raised. A connection that failed or answered late is dropped with every call in flight
on it, never reused; a cancelled call's reply is read and dropped.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import hiredis
from redis.asyncio.connection import AbstractConnection as Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError


def _pack(args: Sequence[str | int]) -> list[bytes]:
    return [hiredis.pack_command(tuple(args))]  # type: ignore[arg-type]


class Lane:
    """Script calls on one pipelined connection: at most `size` calls in flight at once (a
    call beyond that waits for its turn: back-pressure, not an error), all written on the
    same connection as they come and their replies read in order by one reader task, so
    concurrent calls share the socket's writes and reads instead of each taking a connection
    and a round trip of its own. Redis runs one command at a time whatever the connections,
    so one is enough; `size` bounds how long the last call in flight can wait behind the
    others (each call has `timeout_s` from its write to its reply).

    A connection that failed (lost, a reply late past `timeout_s`) is dropped with every call
    in flight on it failing alike (`ConnectionError` / `TimeoutError`: the scripts retry once
    on a fresh one); the next call opens another. A call cancelled while in flight leaves
    the connection as it is (its reply is read and dropped). `on_turn` runs when a call's
    turn comes, before it is written: it may raise to fail the call at once (e.g. Redis
    known to be away while the call waited). `factory` makes an unconnected redis-py
    connection (its URL's settings, TLS and credentials); redis-py connects it and speaks
    the handshake, then the lane writes on its stream itself (redis-py's own write would
    reconnect a dropped connection behind the pipe's back, and drop it when a caller is
    cancelled mid-write) and reads with no socket timeout (the lane times each call)."""

    def __init__(
        self,
        factory: Callable[[], Connection],
        size: int,
        on_turn: Callable[[], None] | None = None,
        timeout_s: float = 1.0,
    ) -> None:
        if size < 1:
            raise ValueError("a lane needs at least one call in flight")
        self.size = size
        self.timeout_s = timeout_s
        self._factory = factory
        self._on_turn = on_turn
        self._turns = asyncio.Semaphore(size)
        self._pipe: _Pipe | None = None
        self._opening: asyncio.Future[_Pipe] | None = None  # a connection being opened
        self.open = 0  # connections made and not dropped: at most 1

    async def call(self, packed: list[bytes]) -> Any:
        """Send one packed command and return its reply (or raise redis-py's error)."""
        async with self._turns:
            if self._on_turn is not None:
                self._on_turn()
            pipe = self._pipe
            if pipe is None or pipe.failed:
                pipe = await self._connect()
            return await pipe.call(packed)

    async def _connect(self) -> _Pipe:
        """The connection being opened, or a new one: calls that need one meanwhile share
        the attempt (and its failure: a Redis that does not answer costs them one
        `timeout_s` together, not one each in turn)."""
        opening = self._opening
        if opening is None:
            self._opening = opening = asyncio.ensure_future(self._open())
            opening.add_done_callback(self._opened)
        return await asyncio.shield(opening)

    def _opened(self, opening: asyncio.Future[_Pipe]) -> None:
        if self._opening is opening:
            self._opening = None
        if not opening.cancelled():
            opening.exception()  # retrieved: its callers may all have been cancelled

    async def _open(self) -> _Pipe:
        conn = self._factory()
        try:
            await asyncio.wait_for(conn.connect(), self.timeout_s)  # type: ignore[no-untyped-call]
        except TimeoutError:
            await conn.disconnect(nowait=True)
            raise RedisTimeoutError("Timeout connecting to Redis") from None
        except BaseException:
            await conn.disconnect(nowait=True)
            raise
        conn.socket_timeout = None  # whatever the URL said: the lane times each call
        self.open += 1
        self._pipe = pipe = _Pipe(conn, self.timeout_s, self._dropped)
        return pipe

    def _dropped(self) -> None:
        self.open -= 1

    async def aclose(self) -> None:
        if self._opening is not None:
            self._opening.cancel()
        pipe, self._pipe = self._pipe, None
        if pipe is not None:
            pipe.fail(RedisConnectionError("The store is closing."))
            await pipe.closed()


class _Pipe:
    """One connected redis-py connection carrying calls in flight: each call's command is
    written on its stream at once (writes are in call order) and its future queued; the
    reader task reads replies in the same order and resolves the futures; a timer fails the
    connection when the oldest call in flight has waited `timeout_s` for its reply. Once
    failed, a pipe takes no more calls (the lane opens another).

    Contract with redis-py (since 4.2): an asyncio connection holds its stream writer in
    `_writer` once connected; tests/state/test_lane.py fails if that changes."""

    def __init__(self, conn: Connection, timeout_s: float, on_drop: Callable[[], None]) -> None:
        self._conn = conn
        writer = conn._writer
        if writer is None:
            raise RedisConnectionError("Redis connection not open")
        self._writer: asyncio.StreamWriter = writer
        self._timeout_s = timeout_s
        self._on_drop = on_drop
        self._loop = asyncio.get_running_loop()
        self._waiting: deque[tuple[float, asyncio.Future[Any]]] = deque()  # (deadline, reply)
        self._timer: asyncio.TimerHandle | None = None
        self._closer: asyncio.Task[None] | None = None
        self.failed = False
        self._reader = self._loop.create_task(self._read())

    async def call(self, packed: list[bytes]) -> Any:
        if self.failed:
            raise RedisConnectionError("The connection to Redis was dropped.")
        reply: asyncio.Future[Any] = self._loop.create_future()
        self._waiting.append((self._loop.time() + self._timeout_s, reply))
        if self._timer is None:
            self._arm()
        self._writer.writelines(packed)  # buffered now, in the order the futures are queued
        try:
            await self._writer.drain()  # flow control only: the bytes are already queued
        except asyncio.CancelledError:
            # The command goes out all the same: its reply will be read and dropped.
            if not reply.done():
                reply.cancel()
            elif not reply.cancelled():
                reply.exception()  # failed meanwhile: retrieved, nobody will await it
            raise
        except Exception as e:
            self.fail(e)  # `reply` now holds the error
        return await reply

    async def _read(self) -> None:
        conn = self._conn
        while True:
            try:
                got: Any = await conn.read_response(disconnect_on_error=False)
            except ResponseError as e:  # the script's (or the server's) error: this call's
                got = e
            except BaseException as e:
                self.fail(e)
                return
            if not self._waiting:
                self.fail(RedisConnectionError("Redis sent a reply nobody asked for."))
                return
            _, reply = self._waiting.popleft()
            if reply.done():  # its caller was cancelled
                continue
            if isinstance(got, ResponseError):
                reply.set_exception(got)
            else:
                reply.set_result(got)

    def _arm(self) -> None:
        self._timer = self._loop.call_at(self._waiting[0][0], self._check)

    def _check(self) -> None:
        """The oldest call's deadline came: fail the connection if it is still waiting, else
        wait for the next oldest call's."""
        self._timer = None
        if not self._waiting:
            return
        if self._waiting[0][0] <= self._loop.time():
            self.fail(RedisTimeoutError("Timeout reading from Redis"))
        else:
            self._arm()

    def fail(self, error: BaseException) -> None:
        """Drop the connection now: every call in flight fails with `error` (a redis-py
        `ConnectionError` when it is not already one of redis-py's or a timeout); a write
        blocked on a full buffer returns at once (the transport is aborted, not closed)."""
        if self.failed:
            return
        self.failed = True
        self._on_drop()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not isinstance(error, (RedisConnectionError, RedisTimeoutError)):
            error = RedisConnectionError(f"Lost the connection to Redis: {error!r}")
        waiting, self._waiting = self._waiting, deque()
        for _, reply in waiting:
            if not reply.done():
                reply.set_exception(error)
        self._writer.transport.abort()
        if asyncio.current_task() is not self._reader:
            self._reader.cancel()
        self._closer = self._loop.create_task(self._conn.disconnect(nowait=True))

    async def closed(self) -> None:
        """Until the reader and the disconnect have ended (after `fail`)."""
        tasks = {t for t in (self._reader, self._closer) if t is not None}
        await asyncio.wait(tasks, timeout=1.0)


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
        self.loading: asyncio.Future[bool] | None = None  # a FUNCTION LOAD on its way

    @staticmethod
    def function_name(library: str, script: str) -> str:
        """The function of `script` in the library named `library`."""
        return f"{library}_{script}"


class Script:
    """One Lua script of a store, `name`: `await script(lane, args)` runs it with the store's
    keys and the leading arguments every call shares (`shared`), then the time, then `args`:
    by FCALL of its function in `library` when there is one and the server runs it, else by
    EVALSHA of `source` (the script whole, shared code included).

    The time is '' (the scripts read Redis `TIME`: common.lua `begin`), or with `clock`
    (tests only) `clock()` as the call is made: a test drives the scripts and the
    in-process store on one clock it sets."""

    def __init__(
        self,
        name: str,
        source: str,
        keys: Sequence[str],
        shared: Sequence[str],
        library: Library | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        self._clock = clock
        now = () if clock is not None else ("",)  # packed once: Redis TIME
        self._head: tuple[str | int, ...] = ("EVALSHA", self.sha, len(keys), *keys, *shared, *now)
        self._library = library
        function = Library.function_name(library.name, name) if library else ""
        self._fcall: tuple[str | int, ...] = ("FCALL", function, len(keys), *keys, *shared, *now)

    async def __call__(self, lane: Lane, args: Sequence[str]) -> Any:
        if self._clock is not None:
            args = (repr(float(self._clock())), *args)
        try:
            return await self._send(lane, args)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            # A kept connection may have died with an earlier server: once more, afresh.
            return await self._send(lane, args)

    async def _send(self, lane: Lane, args: Sequence[str]) -> Any:
        library = self._library
        if library is not None and library.functions:
            packed = _pack((*self._fcall, *args))
            try:
                return await lane.call(packed)
            except ResponseError as e:
                if not _no_function(e):
                    raise  # the script's own error
                # A fresh or restarted Redis lacks the library: send it, call again.
                missing = str(e).startswith("Function not found")
                if missing and await _load(lane, library):
                    return await lane.call(packed)
                # Redis before 7.0, or FCALL / FUNCTION not allowed: EVALSHA from now on.
                library.functions = False
        packed = _pack((*self._head, *args))
        try:
            return await lane.call(packed)
        except NoScriptError:  # a Redis that restarted: load it, run it again
            await lane.call(_pack(("SCRIPT", "LOAD", self.source)))
            return await lane.call(packed)


async def _load(lane: Lane, library: Library) -> bool:
    """FUNCTION LOAD the library; False when the server will not (see `_no_function`). The
    calls that find it missing meanwhile (every call in flight, after a restart) share one
    load instead of each sending the library's ~50 KB."""
    loading = library.loading
    if loading is None:
        library.loading = loading = asyncio.ensure_future(_send_library(lane, library))
        loading.add_done_callback(lambda done: _loaded(library, done))
    return await asyncio.shield(loading)


def _loaded(library: Library, done: asyncio.Future[bool]) -> None:
    if library.loading is done:
        library.loading = None
    if not done.cancelled():
        done.exception()  # retrieved: its callers may all have been cancelled


async def _send_library(lane: Lane, library: Library) -> bool:
    try:
        await lane.call(_pack(("FUNCTION", "LOAD", "REPLACE", library.source)))
    except ResponseError as e:
        if not _no_function(e):
            raise
        return False
    return True
