"""One conformance suite for every state store: each test runs against each backend.

The Redis backend is the test session's real server (`tests/redis_server.py`: a private
`redis-server`, or KVGW_TEST_REDIS_URL), with a key prefix of its own per test. After every
test the store must hold nothing — no lease, no queue entry, no tenant in flight — and every
key it left in Redis must have a TTL; then the test's keys are deleted.
"""

import random
import uuid

import pytest
import redis.asyncio as aioredis

from gateway.core.routing import DEFAULT_SCORERS, Router
from gateway.state.fallback import FailOpenLocal
from gateway.state.memory import InMemoryStore
from gateway.state.redis import RedisStore
from gateway.state.totals import StoreTotals
from tests.redis_server import redis_url


def new_prefix() -> str:
    return f"kvgw-test-{uuid.uuid4().hex[:12]}"


async def keys_without_ttl(prefix: str) -> dict[str, int]:
    """Every key of `prefix` (SCAN) with its TTL in ms; those with none (-1) are the
    failures (-2: gone since the scan, as the TTL clock `{p}:touch` is within 1.3 s)."""
    client = aioredis.from_url(redis_url())
    try:
        found = {}
        async for key in client.scan_iter(match=f"{{{prefix}}}*", count=500):
            found[key.decode()] = await client.pttl(key)
        return found
    finally:
        await client.aclose()


async def drop_keys(prefix: str) -> None:
    client = aioredis.from_url(redis_url())
    try:
        keys = [k async for k in client.scan_iter(match=f"{{{prefix}}}*", count=500)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


async def assert_clean(prefix: str) -> None:
    ttls = await keys_without_ttl(prefix)
    assert all(ttl != -1 for ttl in ttls.values()), f"keys without a TTL: {ttls}"


async def sent_pending(store) -> None:
    """A release the store has not sent yet (a Redis call slower than `timeout_s` on a loaded
    machine marks Redis away for a moment; or a renewal round on its way wrote the lease again
    as it was released) is sent by its renewal task later; send it now, so the check below sees
    what the store will leave behind, not when."""
    redis_store_ = getattr(store, "shared", store)
    if isinstance(redis_store_, RedisStore):
        await redis_store_.flush()


@pytest.fixture
def prefix():
    return new_prefix()


def redis_store(prefix: str, replica: str = "replica-a", **kwargs) -> RedisStore:
    kwargs.setdefault("seed", 0)
    return RedisStore(redis_url(), DEFAULT_SCORERS, replica_id=replica, key_prefix=prefix, **kwargs)


@pytest.fixture(
    params=[
        "memory",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("fail_open_local", marks=pytest.mark.redis),
    ]
)
async def store(request, prefix):
    """Each backend: in-process, Redis, and Redis behind the fail_open_local wrapper (which,
    while Redis answers, must behave exactly as Redis). The wrapped store calls its scripts
    by EVALSHA (`functions=False`, as on a Redis before 7.0), the plain one by FCALL of its
    function library: the suite covers both ways of running the same Lua."""
    if request.param == "memory":
        s = InMemoryStore(Router(), random.Random(0))
    elif request.param == "redis":
        s = redis_store(prefix)
    else:
        shared = redis_store(prefix, functions=False)
        s = FailOpenLocal(shared, InMemoryStore(Router(), random.Random(1)), 0.5)
    try:
        yield s
        await sent_pending(s)
        totals = await s.totals()
        # Every test must leave nothing behind: leases, queue entries, tenant counters.
        assert totals == StoreTotals(), totals
        if request.param != "memory":
            await assert_clean(prefix)
    finally:
        await s.close()
        if request.param != "memory":
            await drop_keys(prefix)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def store_with(request, prefix):
    """Like `store`, built with the given keyword arguments (e.g. `burst_blocks`)."""
    made = []

    def make(**kwargs):
        if request.param == "memory":
            s = InMemoryStore(Router(), random.Random(0), **kwargs)
        else:
            s = redis_store(prefix, **kwargs)
        made.append(s)
        return s

    try:
        yield make
        for s in made:
            await sent_pending(s)
            totals = await s.totals()
            assert totals == StoreTotals(), totals
        if request.param == "redis":
            await assert_clean(prefix)
    finally:
        for s in made:
            await s.close()
        if request.param == "redis":
            await drop_keys(prefix)
