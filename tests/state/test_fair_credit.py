"""The line's burst credit, on both backends. (That the two order the line alike, rule for
rule: tests/state/test_lua_differential.py.)"""

from gateway.core.types import TenantPolicy
from gateway.state.base import Lease, Refusal
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
