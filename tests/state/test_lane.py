"""The Redis store's script calls on one pipelined connection (`gateway.state.scripts.Lane`):
concurrent calls share it and each gets its own reply; a cancelled call leaves the others'
replies in order; a reply later than `timeout_s` fails the calls in flight and the next call
gets a fresh connection. Real Redis (the session's server)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from gateway.state.base import Lease
from gateway.state.errors import StateUnavailable
from gateway.state.redis import RETRY_REDIS_AFTER_S
from gateway.state.scripts import Lane, _pack
from tests.redis_server import redis_url

from .conftest import drop_keys, redis_store
from .test_conformance import ask, spec

pytestmark = pytest.mark.redis

# Holds Redis's one thread for ARGV[1] µs (as a slow script of another client would).
BUSY = """
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
while true do
  t = redis.call('TIME')
  if t[1] * 1000000 + t[2] - start > tonumber(ARGV[1]) then return 1 end
end
"""


async def _connected_clients(client: aioredis.Redis) -> int:
    return int((await client.info("clients"))["connected_clients"])


async def test_concurrent_calls_share_one_connection_each_with_its_own_reply(prefix):
    client = aioredis.from_url(redis_url())
    store = redis_store(prefix)
    try:
        before = await _connected_clients(client)
        a = spec("a", blocks=1000, seqs=1000)
        asks = [ask(a, blocks=1) for _ in range(200)]
        got = await asyncio.gather(*(store.try_admit(x) for x in asks))
        assert [g.id for g in got] == [x.lease_id for x in asks]  # nobody got another's reply
        assert store._request_lane.open == 1
        # The request path's one connection, and the listener's; no more.
        assert await _connected_clients(client) - before <= 2
        assert all(await asyncio.gather(*(store.release(g) for g in got)))
        assert (await store.totals()).empty
    finally:
        await store.close()
        await client.aclose()
        await drop_keys(prefix)


async def test_a_cancelled_call_leaves_the_others_replies_in_order(prefix):
    store = redis_store(prefix, lease_ttl_s=1.0)
    try:
        a = spec("a", blocks=1000, seqs=1000)
        asks = [ask(a, blocks=1) for _ in range(40)]
        tasks = [asyncio.ensure_future(store.try_admit(x)) for x in asks]
        await asyncio.sleep(0)  # every call written, none answered yet
        for t in tasks[1::2]:
            t.cancel()
        kept = await asyncio.gather(*tasks[0::2])
        assert [g.id for g in kept] == [x.lease_id for x in asks[0::2]]
        assert all(t.cancelled() for t in tasks[1::2])
        # The connection stays in use: the next call is answered on it.
        after = await store.try_admit(ask(a, blocks=1))
        assert isinstance(after, Lease) and store._request_lane.open == 1
        for g in (*kept, after):
            assert await store.release(g) is True
    finally:
        await store.close()
        await drop_keys(prefix)


async def test_a_late_reply_fails_the_calls_in_flight_and_the_next_call_reconnects(prefix):
    client = aioredis.from_url(redis_url())
    store = redis_store(prefix, timeout_s=0.3, lease_ttl_s=1.0)
    try:
        a = spec("a", blocks=1000, seqs=1000)
        warm = await store.try_admit(ask(a, blocks=1))  # connected
        assert isinstance(warm, Lease) and await store.release(warm) is True
        busy = asyncio.ensure_future(client.eval(BUSY, 0, 1_500_000))
        await asyncio.sleep(0.05)  # the busy script is running
        started = time.monotonic()
        results = await asyncio.gather(
            *(store.try_admit(ask(a, blocks=1)) for _ in range(5)), return_exceptions=True
        )
        waited = time.monotonic() - started
        # Each timed out after 0.3 s and tried once more on a fresh connection, whose
        # opening they shared (0.3 s more, not 0.3 s each in turn), then gave up.
        assert all(isinstance(r, StateUnavailable) for r in results), results
        assert 0.5 < waited < 1.3, waited
        assert store._request_lane.open == 0  # the late connections were dropped
        assert await busy == 1
        await asyncio.sleep(RETRY_REDIS_AFTER_S)
        back = await store.try_admit(ask(a, blocks=1))
        assert isinstance(back, Lease) and store._request_lane.open == 1
        assert await store.release(back) is True
    finally:
        await store.close()
        await client.aclose()
        await drop_keys(prefix)


async def test_a_call_cancelled_in_the_middle_of_its_write_leaves_the_connection_working():
    """A command too large for the socket's buffer at once: its caller, cancelled while the
    write waits (`drain`), gives up its reply, not the connection (redis-py's own write
    would drop it, and then open another behind the pipe's back)."""
    lane = Lane(aioredis.ConnectionPool.from_url(redis_url()).make_connection, 8, None, 5.0)
    try:
        assert await lane.call(_pack(("PING",))) == b"PONG"
        big = asyncio.ensure_future(lane.call(_pack(("ECHO", "x" * 8_000_000))))
        await asyncio.sleep(0)  # written into the buffer, waiting for it to drain
        assert not big.done()
        big.cancel()
        assert await lane.call(_pack(("ECHO", "after"))) == b"after"  # its own reply
        assert big.cancelled() and lane.open == 1
    finally:
        await lane.aclose()
    assert lane.open == 0
