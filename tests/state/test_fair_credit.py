"""The line's burst credit, on both backends; and the two backends order the line alike."""

import random
from dataclasses import replace

import pytest

from gateway.core.routing import Router
from gateway.core.types import TenantPolicy
from gateway.state.base import Lease, Refusal
from gateway.state.memory import InMemoryStore
from tests.state.conftest import drop_keys, new_prefix, redis_store
from tests.state.test_conformance import queue_entry, release_all, spec, tenant_ask


async def fill_history(store, a, tenant, blocks, times):
    """`tenant` takes and gives back `blocks` directly `times` times: V moves on."""
    for _ in range(times):
        lease = await store.try_admit(tenant_ask(a, tenant, blocks=blocks))
        assert isinstance(lease, Lease), lease
        await store.release(lease)


async def test_an_idle_tenant_goes_ahead_by_at_most_its_credit(store_with):
    store = store_with(burst_blocks=16)
    a = spec("a", blocks=101, seqs=100)  # 100 blocks
    noisy, quiet = TenantPolicy("noisy"), TenantPolicy("quiet")
    await fill_history(store, a, noisy, 50, 3)  # served starts 0, 50, 100: V = 100
    hog = await store.try_admit(tenant_ask(a, noisy, blocks=100))  # start 150, F 250
    assert isinstance(hog, Lease)
    n = [tenant_ask(a, noisy, blocks=10, queued=True) for _ in range(2)]  # starts 250, 260
    q = [tenant_ask(a, quiet, blocks=10, queued=True) for _ in range(3)]  # 234, 244, 254
    for x in [*n, *q]:
        assert await store.enqueue(queue_entry(x, x.tenant, 10), max_length=10) == "queued"
    await store.release(hog)
    # Order: quiet, quiet (credited: before V = 250), noisy, quiet, noisy.
    assert await store.try_admit(n[0]) == Refusal("queued_ahead")
    assert await store.try_admit(q[2]) == Refusal("queued_ahead")
    got = [await store.try_admit(q[0]), await store.try_admit(q[1])]
    assert await store.try_admit(q[2]) == Refusal("queued_ahead")  # noisy's first is ahead
    got += [await store.try_admit(x) for x in (n[0], q[2], n[1])]
    assert all(isinstance(g, Lease) for g in got), got
    await release_all(store, got)


async def test_without_credit_the_idle_tenant_waits_behind_the_head(store_with):
    store = store_with(burst_blocks=0)
    a = spec("a", blocks=101, seqs=100)
    noisy, quiet = TenantPolicy("noisy"), TenantPolicy("quiet")
    await fill_history(store, a, noisy, 50, 3)
    hog = await store.try_admit(tenant_ask(a, noisy, blocks=100))
    n = tenant_ask(a, noisy, blocks=10, queued=True)  # start 250
    q = tenant_ask(a, quiet, blocks=10, queued=True)  # start 250, later arrival
    for x in (n, q):
        assert await store.enqueue(queue_entry(x, x.tenant, 10), max_length=10) == "queued"
    await store.release(hog)
    assert await store.try_admit(q) == Refusal("queued_ahead")
    got = [await store.try_admit(n), await store.try_admit(q)]
    assert all(isinstance(g, Lease) for g in got), got
    await release_all(store, got)


async def test_a_newcomer_with_credit_passes_a_waiting_backlog(store_with):
    store = store_with(burst_blocks=10)
    a = spec("a", blocks=101, seqs=100)
    noisy, quiet = TenantPolicy("noisy"), TenantPolicy("quiet")
    await fill_history(store, a, noisy, 50, 3)
    held = await store.try_admit(tenant_ask(a, noisy, blocks=90))
    waiting = tenant_ask(a, noisy, blocks=20, queued=True)
    assert await store.enqueue(queue_entry(waiting, noisy, 20), max_length=10) == "queued"
    # Tags: noisy's waiting entry starts at 240 (= V); quiet's fresh ask at 240 − 10.
    # 10 blocks free: quiet's fresh ask stands before noisy's waiting entry and takes them.
    fresh = await store.try_admit(tenant_ask(a, quiet, blocks=10))
    assert isinstance(fresh, Lease)
    # Its credit is spent by that: the next one stands behind the waiting entry.
    assert await store.try_admit(tenant_ask(a, quiet, blocks=1)) == Refusal("queued_ahead")
    await store.dequeue(waiting.lease_id)
    await release_all(store, [held, fresh])


@pytest.mark.redis
@pytest.mark.parametrize("seed", range(12))
async def test_both_backends_decide_alike(seed):
    """One random sequence of admissions, joins, departures and releases by tenants of
    different weights and priorities, run on the in-process store and on Redis: every
    verdict is the same (the Lua scripts implement the core's order and credit).

    The headroom rule is off here: it reads time-averaged usage, which each store takes from
    its own clock at a slightly different moment; tests/state/test_headroom.py runs it on
    both backends."""
    rng = random.Random(seed)
    burst = rng.choice([0, 5, 20, 64])
    memory = InMemoryStore(Router(), random.Random(0), burst_blocks=burst, headroom=0.0)
    prefix = new_prefix()
    shared = redis_store(prefix, burst_blocks=burst, headroom=0.0)
    stores = (memory, shared)
    a = spec("a", blocks=41, seqs=100)
    tenants = [
        TenantPolicy("t1"),
        TenantPolicy("t2", weight=2.0),
        TenantPolicy("t3", weight=0.5),
        TenantPolicy("vip", priority=1),
    ]
    queued: list = []
    held: list[list[Lease]] = []
    try:
        for _ in range(120):
            op = rng.random()
            if op < 0.45:
                tenant = rng.choice(tenants[:3] if rng.random() < 0.9 else tenants)
                x = tenant_ask(a, tenant, blocks=rng.randint(1, 12))
                got = [await s.try_admit(x) for s in stores]
                assert type(got[0]) is type(got[1]) and (
                    isinstance(got[0], Lease) or got[0] == got[1]
                ), got
                if isinstance(got[0], Lease):
                    held.append(got)
                else:
                    e = queue_entry(x, tenant, x.candidates[0].need.blocks, max_wait_s=600)
                    verdicts = [await s.enqueue(e, max_length=30) for s in stores]
                    assert verdicts[0] == verdicts[1]
                    queued.append(replace(x, queued=True))
            elif op < 0.7 and held:
                leases = held.pop(rng.randrange(len(held)))
                for s, lease in zip(stores, leases, strict=True):
                    await s.release(lease)
            elif op < 0.8 and queued:
                x = queued.pop(rng.randrange(len(queued)))
                for s in stores:
                    await s.dequeue(x.lease_id)
            # Waiters retry in the order they joined; a refusal must be the same on both.
            for x in list(queued):
                got = [await s.try_admit(x) for s in stores]
                assert type(got[0]) is type(got[1]) and (
                    isinstance(got[0], Lease) or got[0] == got[1]
                ), got
                if isinstance(got[0], Lease):
                    queued.remove(x)
                    held.append(got)
            assert await memory.queue_length() == await shared.queue_length()
        for x in queued:
            for s in stores:
                await s.dequeue(x.lease_id)
        for leases in held:
            for s, lease in zip(stores, leases, strict=True):
                await s.release(lease)
        for s in stores:
            assert await s.totals() == await memory.totals()
    finally:
        for s in stores:
            await s.close()
        await drop_keys(prefix)
