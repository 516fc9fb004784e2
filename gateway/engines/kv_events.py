"""The I/O edge of the prefix index's exact mode: one ZMQ SUB socket per engine that publishes
its KV-cache events (`engines[].kv_events`), each message decoded (`decode_message`) and
handed on; the rules are in gateway/core/kv_events.py.

Needs pyzmq and msgspec (`pip install 'kv-gateway[kv-events]'`): this module imports them,
and is imported only when an engine is configured with `kv_events`.

ZMQ reconnects by itself when the engine goes away and comes back; what was published while
no socket was connected is lost, which the sequence numbers show (gateway/core/kv_events.py
`EventFeed`). vLLM's replay socket is not used: a gap forgets the engine's index instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence

import msgspec
import zmq
import zmq.asyncio

from gateway.core.kv_events import EventBatch, EventFormatError, parse_batch

log = logging.getLogger(__name__)


def decode_message(frames: Sequence[bytes]) -> EventBatch:
    """One message of vLLM's publisher, `(topic, sequence, payload)`, as a batch; raises
    `EventFormatError` for anything else."""
    if len(frames) != 3:
        raise EventFormatError(f"a message of {len(frames)} frames, expected 3")
    try:
        payload = msgspec.msgpack.decode(frames[2])
    except msgspec.DecodeError as e:
        raise EventFormatError(f"payload is not msgpack: {e}") from None
    return parse_batch(frames[1], payload)


class KvEventSubscriber:
    """Follows each engine's publisher (`endpoints`: engine name -> `tcp://host:port`) and
    calls `on_batch(engine, batch)` for every batch, `on_lost(engine)` for a message it could
    not read (what the engine caches is then unknown)."""

    def __init__(
        self,
        endpoints: Mapping[str, str],
        on_batch: Callable[[str, EventBatch], None],
        on_lost: Callable[[str], None],
    ) -> None:
        self.endpoints = dict(endpoints)
        self.on_batch = on_batch
        self.on_lost = on_lost
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        for engine, endpoint in self.endpoints.items():
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(endpoint)
            log.info("engine %s: following its KV events at %s", engine, endpoint)
            self._tasks.append(
                asyncio.create_task(self._follow(engine, sock), name=f"kv-events-{engine}")
            )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # closes the sockets of tasks that never ran, too
            self._ctx = None

    async def _follow(self, engine: str, sock: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    batch = decode_message(frames)
                except EventFormatError as e:
                    log.warning("engine %s: unreadable KV event message: %s", engine, e)
                    self.on_lost(engine)
                    continue
                try:
                    self.on_batch(engine, batch)
                except Exception:  # a bug must not stop the following: forget, go on
                    log.exception("engine %s: KV event batch %d not applied", engine, batch.seq)
                    self.on_lost(engine)
        finally:
            sock.close(linger=0)
