import asyncio
import itertools
from dataclasses import replace

import pytest

from gateway.core.routing import Candidate
from gateway.core.types import (
    DEFAULT_TENANT,
    EngineLoad,
    EngineSpec,
    EngineView,
    Footprint,
    TenantPolicy,
)
from gateway.state.base import (
    AdmissionAsk,
    Lease,
    QueueEntry,
    RateLimitState,
    Refusal,
)

_ids = itertools.count()


def spec(name, blocks=11, seqs=4):
    return EngineSpec(name, f"http://{name}", frozenset({"m"}), blocks, 16, seqs, 2048)


def ask(*engines, blocks=2, seqs=1, ceiling=1.0, healthy=True):
    cands = tuple(
        Candidate(
            EngineView(e, EngineLoad(), healthy=healthy), Footprint(blocks, seqs, blocks * 16)
        )
        for e in engines
    )
    return AdmissionAsk(lease_id=f"lease-{next(_ids)}", candidates=cands, kv_ceiling=ceiling)


async def test_admit_writes_a_lease_and_release_is_idempotent(store):
    a = spec("a")
    lease = await store.try_admit(ask(a, blocks=3))
    assert isinstance(lease, Lease) and (lease.engine, lease.blocks, lease.seqs) == ("a", 3, 1)
    assert (await store.loads())["a"] == EngineLoad(3, 1)
    assert await store.release(lease) is True
    assert await store.release(lease) is False
    assert (await store.loads()).get("a", EngineLoad()) == EngineLoad()


async def test_routes_to_most_free_blocks(store):
    a, b = spec("a", blocks=11), spec("b", blocks=21)
    first = await store.try_admit(ask(a, b, blocks=4))
    assert first.engine == "b"  # 20 free vs 10
    second = await store.try_admit(ask(a, b, blocks=4))
    assert second.engine == "b"  # 16 vs 10
    third = await store.try_admit(ask(a, b, blocks=4))
    assert third.engine == "b"  # 12 vs 10
    fourth = await store.try_admit(ask(a, b, blocks=4))
    assert fourth.engine == "a"  # 8 vs 10
    for lease in (first, second, third, fourth):
        await store.release(lease)


async def test_refuses_when_blocks_or_seqs_run_out(store):
    a = spec("a", blocks=11, seqs=2)
    held = [await store.try_admit(ask(a, blocks=5)) for _ in range(2)]
    assert all(isinstance(h, Lease) for h in held)
    assert await store.try_admit(ask(a, blocks=1)) == Refusal("no_capacity")  # seqs: 2 of 2
    await store.release(held[0])
    assert isinstance(await store.try_admit(ask(a, blocks=6)), Refusal)  # 5 free blocks
    small = await store.try_admit(ask(a, blocks=5))
    assert isinstance(small, Lease)
    for lease in (held[1], small):
        await store.release(lease)


async def test_staged_slots_admit_beyond_max_num_seqs(store):
    # Two slots and one staged: three sequences on the engine, the fourth waits.
    a = spec("a", blocks=11, seqs=2)

    def staged_ask() -> AdmissionAsk:
        view = EngineView(a, EngineLoad(), staged_seqs=1)
        cand = Candidate(view, Footprint(1, 1, 16))
        return AdmissionAsk(lease_id=f"lease-{next(_ids)}", candidates=(cand,), kv_ceiling=1.0)

    held = [await store.try_admit(staged_ask()) for _ in range(3)]
    assert all(isinstance(h, Lease) for h in held)
    assert await store.try_admit(staged_ask()) == Refusal("no_capacity")
    assert await store.try_admit(ask(a, blocks=1)) == Refusal("no_capacity")  # unstaged: 2
    for lease in held:
        await store.release(lease)


async def test_ceiling_and_health_respected(store):
    a = spec("a", blocks=11)
    assert isinstance(await store.try_admit(ask(a, blocks=6, ceiling=0.5)), Refusal)  # 5 of 10
    lease = await store.try_admit(ask(a, blocks=5, ceiling=0.5))
    assert isinstance(lease, Lease)
    await store.release(lease)
    assert isinstance(await store.try_admit(ask(a, blocks=1, healthy=False)), Refusal)


async def test_concurrent_admissions_never_overcommit(store):
    a, b = spec("a", blocks=11, seqs=100), spec("b", blocks=7, seqs=100)
    results = await asyncio.gather(*(store.try_admit(ask(a, b, blocks=3)) for _ in range(50)))
    leases = [lease for lease in results if isinstance(lease, Lease)]
    by_engine = {"a": 0, "b": 0}
    for lease in leases:
        by_engine[lease.engine] += lease.blocks
    assert by_engine["a"] <= 10 and by_engine["b"] <= 6
    assert len(leases) == 3 + 2  # 10 // 3 + 6 // 3
    await asyncio.gather(*(store.release(lease) for lease in leases))


def entry(a: AdmissionAsk, engines, blocks=2):
    return QueueEntry(a.lease_id, DEFAULT_TENANT, frozenset(engines), blocks, 10.0)


async def test_queued_entries_are_not_overtaken(store):
    a = spec("a", blocks=11)
    hog = await store.try_admit(ask(a, blocks=9))
    first = ask(a, blocks=5)
    assert await store.try_admit(first) == Refusal("no_capacity")
    assert await store.enqueue(entry(first, {"a"}, 5), max_length=10) == "queued"
    assert await store.queue_length() == 1
    assert await store.blocks_ahead(frozenset({"a"})) == 5
    # A newcomer that would fit (1 free block) must wait behind the queued entry.
    newcomer = ask(a, blocks=1)
    assert await store.try_admit(newcomer) == Refusal("queued_ahead")
    # An ask for other engines is not held up.
    b = spec("b")
    other = await store.try_admit(ask(b, blocks=1))
    assert isinstance(other, Lease)
    await store.release(hog)
    got = await store.try_admit(replace(first, queued=True))
    assert isinstance(got, Lease)
    assert await store.queue_length() == 0  # admission took it off the line
    for lease in (got, other):
        await store.release(lease)


async def test_queue_bound_and_idempotent_dequeue(store):
    a = spec("a")
    asks = [ask(a) for _ in range(3)]
    assert [await store.enqueue(entry(x, {"a"}), max_length=2) for x in asks] == [
        "queued",
        "queued",
        "queue_full",
    ]
    for x in asks:
        await store.dequeue(x.lease_id)
        await store.dequeue(x.lease_id)
    assert await store.queue_length() == 0


async def test_release_by_id_and_wait_for_change(store):
    a = spec("a")
    lease = await store.try_admit(ask(a, blocks=2))
    # Notices are for waiters, and a waiter has an entry in the line.
    waiting = ask(a, blocks=20)
    assert await store.enqueue(entry(waiting, {"a"}, 20), max_length=10) == "queued"
    # A change notice may come early (the admission's own, on Redis): the contract is "may have
    # changed". Wait until a waiter stays put, then check that the release wakes it.
    for _ in range(20):
        waiter = asyncio.create_task(store.wait_for_change(5.0))
        await asyncio.sleep(0.05)
        if not waiter.done():
            break
    assert not waiter.done()
    # Release by id alone (what a cancelled admission does) frees the real reservation.
    assert await store.release(Lease(id=lease.id, engine="", blocks=0, seqs=0)) is True
    await asyncio.wait_for(waiter, 2.0)  # woken by the release, not by the timeout
    assert (await store.loads()).get("a", EngineLoad()) == EngineLoad()
    await store.dequeue(waiting.lease_id)


# ---- tenants ---------------------------------------------------------------------------


def tenant_ask(engine, tenant, *, blocks=2, tokens=0, max_blocks=None, queued=False, lease_id=None):
    a = ask(engine, blocks=blocks)
    return replace(
        a,
        lease_id=lease_id or a.lease_id,
        tenant=tenant,
        tokens=tokens,
        tenant_max_blocks=max_blocks,
        queued=queued,
    )


async def release_all(store, leases):
    for lease in leases:
        assert await store.release(lease) is True


async def test_tenant_concurrency(store):
    a, t = spec("a", blocks=101, seqs=100), TenantPolicy("t", max_concurrency=2)
    held = [await store.try_admit(tenant_ask(a, t)) for _ in range(2)]
    assert all(isinstance(h, Lease) for h in held)
    assert await store.try_admit(tenant_ask(a, t)) == Refusal("tenant_concurrency")
    other = await store.try_admit(tenant_ask(a, TenantPolicy("u", max_concurrency=1)))
    assert isinstance(other, Lease)  # limits are per tenant
    await store.release(held[0])
    again = await store.try_admit(tenant_ask(a, t))
    assert isinstance(again, Lease)
    await release_all(store, [held[1], other, again])


async def test_tenant_rpm_refusal_charges_nothing(store):
    a, t = spec("a", blocks=101, seqs=100), TenantPolicy("t", rpm=2)
    first = await store.try_admit(tenant_ask(a, t))
    state = await store.rate_limits(t)
    assert (state.limit_requests, state.remaining_requests) == (2, 1)
    # 2 rpm: one per 30 s (the tolerance is for a slow machine between the calls).
    assert state.reset_requests_s == pytest.approx(30, abs=2)
    second = await store.try_admit(tenant_ask(a, t))
    refused = await store.try_admit(tenant_ask(a, t))
    assert refused.code == "tenant_rpm"
    assert refused.retry_after_s == pytest.approx(30, abs=2)  # room for one in 30 s
    assert (await store.rate_limits(t)).remaining_requests == 0
    # Released requests do not give requests back (the minute still counts them).
    await release_all(store, [first, second])
    assert (await store.try_admit(tenant_ask(a, t))).code == "tenant_rpm"


async def test_tenant_tpm_charge_and_refund(store):
    # 10 tokens per minute: one token back every 6 s, so the exact counts below hold however
    # slowly the machine runs the few calls between them.
    a, t = spec("a", blocks=101, seqs=100), TenantPolicy("t", tpm=10)
    first = await store.try_admit(tenant_ask(a, t, tokens=6))
    assert isinstance(first, Lease) and first.tokens == 6
    refused = await store.try_admit(tenant_ask(a, t, tokens=6))
    # 4 left; 2 more at 10/60 per second → 12 s.
    assert refused.code == "tenant_tpm" and refused.retry_after_s == pytest.approx(12, abs=1)
    state = await store.rate_limits(t)
    assert (state.limit_tokens, state.remaining_tokens) == (10, 4)
    # Used 1 of the 6 charged: 5 come back.
    assert await store.release(first, used_tokens=1) is True
    assert (await store.rate_limits(t)).remaining_tokens == 9
    second = await store.try_admit(tenant_ask(a, t, tokens=6))
    assert isinstance(second, Lease)
    # More than the whole bucket can never pass.
    assert await store.try_admit(tenant_ask(a, t, tokens=11)) == Refusal("tenant_tpm", None)
    await store.release(second, used_tokens=6)
    assert (await store.rate_limits(t)).remaining_tokens == 3


async def test_tenant_kv_share(store):
    a, t = spec("a", blocks=101, seqs=100), TenantPolicy("t", kv_share=0.05)
    held = await store.try_admit(tenant_ask(a, t, blocks=3, max_blocks=5))
    assert isinstance(held, Lease)
    assert await store.try_admit(tenant_ask(a, t, blocks=3, max_blocks=5)) == Refusal(
        "tenant_kv_share"
    )
    fits = await store.try_admit(tenant_ask(a, t, blocks=2, max_blocks=5))
    assert isinstance(fits, Lease)
    other = await store.try_admit(tenant_ask(a, TenantPolicy("u"), blocks=50, max_blocks=50))
    assert isinstance(other, Lease)
    await release_all(store, [held, fits, other])


async def test_rate_limits_without_limits(store):
    assert await store.rate_limits(TenantPolicy("free")) == RateLimitState()


# ---- the fair line ---------------------------------------------------------------------


def queue_entry(a, tenant, blocks=2, max_wait_s=10.0):
    engines = frozenset(c.view.spec.name for c in a.candidates)
    return QueueEntry(a.lease_id, tenant, engines, blocks, max_wait_s)


async def test_fair_order_across_tenants(store):
    a = spec("a", blocks=11, seqs=100)
    hog = await store.try_admit(ask(a, blocks=10))
    ta, tb = TenantPolicy("ta"), TenantPolicy("tb")
    a_asks = [tenant_ask(a, ta, queued=True) for _ in range(3)]
    b_ask = tenant_ask(a, tb, queued=True)
    assert await store.try_admit(replace(a_asks[0], queued=False)) == Refusal("no_capacity")
    for x in [*a_asks, b_ask]:
        assert await store.enqueue(queue_entry(x, x.tenant), max_length=10) == "queued"
    # Tags: ta 0, 2, 4; tb 0 (after ta's first by arrival): tb's one entry is second.
    await store.release(hog)
    assert await store.try_admit(a_asks[1]) == Refusal("queued_ahead")
    assert await store.try_admit(b_ask) == Refusal("queued_ahead")
    got = [await store.try_admit(x) for x in (a_asks[0], b_ask, a_asks[1], a_asks[2])]
    assert all(isinstance(g, Lease) for g in got), got
    assert await store.queue_length() == 0
    await release_all(store, got)


async def test_a_flooding_tenant_does_not_push_a_quiet_one_back(store):
    a = spec("a", blocks=11, seqs=100)
    hog = await store.try_admit(ask(a, blocks=10))
    noisy, quiet = TenantPolicy("noisy"), TenantPolicy("quiet")
    flood = [tenant_ask(a, noisy, queued=True) for _ in range(20)]
    for x in flood:
        assert await store.enqueue(queue_entry(x, noisy), max_length=100) == "queued"
    calm = tenant_ask(a, quiet, queued=True)
    assert await store.enqueue(queue_entry(calm, quiet), max_length=100) == "queued"
    await store.release(hog)
    assert await store.try_admit(calm) == Refusal("queued_ahead")  # one noisy entry first
    first = await store.try_admit(flood[0])
    second = await store.try_admit(calm)
    assert isinstance(first, Lease) and isinstance(second, Lease)
    for x in flood[1:]:
        await store.dequeue(x.lease_id)
    await release_all(store, [first, second])


async def test_priority_passes_lower_classes(store):
    a = spec("a", blocks=11, seqs=100)
    held = await store.try_admit(ask(a, blocks=6))
    big = tenant_ask(a, TenantPolicy("low"), blocks=8, queued=True)
    assert await store.enqueue(queue_entry(big, big.tenant, 8), max_length=10) == "queued"
    # Same class: the small newcomer may not overtake the waiting big one...
    assert await store.try_admit(tenant_ask(a, TenantPolicy("peer"))) == Refusal("queued_ahead")
    # ...a higher class may (it stands first in the line).
    vip = await store.try_admit(tenant_ask(a, TenantPolicy("vip", priority=5)))
    assert isinstance(vip, Lease)
    await store.dequeue(big.lease_id)
    await release_all(store, [held, vip])


async def test_tenant_queue_cap_and_idempotent_enqueue(store):
    a = spec("a")
    capped = TenantPolicy("capped", max_queued=1)
    x, y, z = (tenant_ask(a, capped) for _ in range(3))
    assert await store.enqueue(queue_entry(x, capped), max_length=10) == "queued"
    assert await store.enqueue(queue_entry(x, capped), max_length=10) == "queued"  # same id
    assert await store.queue_length() == 1
    assert await store.enqueue(queue_entry(y, capped), max_length=10) == "tenant_queue_full"
    free = TenantPolicy("free")
    assert await store.enqueue(queue_entry(z, free), max_length=10) == "queued"
    assert await store.enqueue(queue_entry(y, free), max_length=2) == "queue_full"
    for entry_id in (x.lease_id, z.lease_id):
        await store.dequeue(entry_id)


async def test_queue_entries_expire(store):
    a = spec("a")
    gone = ask(a)
    assert await store.enqueue(queue_entry(gone, DEFAULT_TENANT, max_wait_s=1.0), 10) == "queued"
    assert await store.try_admit(ask(a)) == Refusal("queued_ahead")
    waiter = asyncio.create_task(store.wait_for_change(5.0))
    await asyncio.sleep(1.3)
    # The crashed waiter's entry no longer holds the line.
    lease = await store.try_admit(ask(a))
    assert isinstance(lease, Lease)
    assert await store.queue_length() == 0
    await asyncio.wait_for(waiter, 5.0)
    await store.release(lease)


async def test_blocks_ahead_counts_competing_entries(store):
    a, b = spec("a"), spec("b")
    xs = [ask(a), ask(a, b), ask(b)]
    for x, blocks in zip(xs, (1, 2, 4), strict=True):
        assert await store.enqueue(queue_entry(x, DEFAULT_TENANT, blocks), 10) == "queued"
    assert await store.blocks_ahead(frozenset({"a"})) == 3
    assert await store.blocks_ahead(frozenset({"b"})) == 6
    assert await store.blocks_ahead(frozenset({"c"})) == 0
    for x in xs:
        await store.dequeue(x.lease_id)


async def test_fresh_ask_of_a_queued_tenant_waits_behind_its_own_entry(store):
    a, b = spec("a"), spec("b")
    t = TenantPolicy("t")
    waiting = tenant_ask(a, t, queued=True)
    assert await store.enqueue(queue_entry(waiting, t), 10) == "queued"
    assert await store.try_admit(tenant_ask(a, t)) == Refusal("queued_ahead")
    elsewhere = await store.try_admit(tenant_ask(b, t))  # other engines are not held up
    assert isinstance(elsewhere, Lease)
    own = await store.try_admit(waiting)  # a queued ask passes itself
    assert isinstance(own, Lease)
    await release_all(store, [elsewhere, own])


async def test_an_entry_leaving_unserved_closes_its_tenants_gap(store):
    a = spec("a", blocks=101, seqs=100)
    hog = await store.try_admit(ask(a, blocks=100))
    ta, tb = TenantPolicy("ta"), TenantPolicy("tb")
    xa = [tenant_ask(a, ta, queued=True) for _ in range(3)]  # tags 0, 2, 4
    xb = [tenant_ask(a, tb, queued=True) for _ in range(3)]  # tags 0, 2, 4 (later arrivals)
    for x in [*xa, *xb]:
        assert await store.enqueue(queue_entry(x, x.tenant), max_length=10) == "queued"
    await store.dequeue(xa[1].lease_id)  # ta's second gives up: its third moves to tag 2
    await store.release(hog)
    got = [await store.try_admit(x) for x in (xa[0], xb[0])]
    assert await store.try_admit(xb[1]) == Refusal("queued_ahead")  # ta's third is ahead
    got += [await store.try_admit(x) for x in (xa[2], xb[1], xb[2])]
    assert all(isinstance(g, Lease) for g in got), got
    await release_all(store, got)


# ---- extending a lease (a request that outgrew a predicted reservation) ---------------


async def test_extend_counts_the_new_blocks_everywhere(store):
    a, t = spec("a", blocks=21, seqs=100), TenantPolicy("t", kv_share=0.5)
    lease = await store.try_admit(tenant_ask(a, t, blocks=4, max_blocks=10))
    grown = await store.extend(lease, 5)
    assert (grown.id, grown.engine, grown.blocks, grown.seqs) == (lease.id, "a", 9, 1)
    assert (await store.loads())["a"] == EngineLoad(9, 1)
    # The engine sees them (12 of 20 blocks free → 13 do not fit) ...
    assert await store.try_admit(ask(a, blocks=12)) == Refusal("no_capacity")
    # ... and so does the tenant's share (9 held + 2 > 10).
    assert await store.try_admit(tenant_ask(a, t, blocks=2, max_blocks=10)) == Refusal(
        "tenant_kv_share"
    )
    assert await store.release(grown) is True
    assert await store.loads() == {}


async def test_extend_may_pass_the_ceiling_but_not_revive_a_released_lease(store):
    a = spec("a", blocks=11)
    lease = await store.try_admit(ask(a, blocks=8))
    grown = await store.extend(lease, 6)  # the engine already holds them: never refused
    assert grown.blocks == 14 and (await store.loads())["a"] == EngineLoad(14, 1)
    assert await store.try_admit(ask(a, blocks=1)) == Refusal("no_capacity")
    assert await store.release(grown) is True
    after = await store.extend(grown, 3)  # gone: nothing is counted
    assert after == grown
    assert await store.loads() == {}
    assert await store.release(grown) is False


async def test_a_granted_lease_carries_the_rate_limits_it_left(store):
    # 60 tokens per minute: one back per second, so the exact counts hold between calls.
    a, t = spec("a", blocks=101, seqs=100), TenantPolicy("t", rpm=10, tpm=60)
    first = await store.try_admit(tenant_ask(a, t, tokens=30))
    second = await store.try_admit(tenant_ask(a, t, tokens=20))
    assert (first.rates.limit_requests, first.rates.remaining_requests) == (10, 9)
    assert (first.rates.limit_tokens, first.rates.remaining_tokens) == (60, 30)
    assert (second.rates.remaining_requests, second.rates.remaining_tokens) == (8, 10)
    now = await store.rate_limits(t)  # the same as the store says, but for the clock
    assert (now.remaining_requests, now.remaining_tokens) == (8, 10)
    assert second.rates.reset_tokens_s == pytest.approx(now.reset_tokens_s, abs=1)
    assert second.rates.reset_requests_s == pytest.approx(now.reset_requests_s, abs=1)
    free = await store.try_admit(tenant_ask(a, TenantPolicy("free")))
    assert free.rates is None  # no limits, nothing to report
    await release_all(store, [first, second, free])


async def test_an_extended_lease_charges_its_tenant_in_the_fair_line(store):
    a = spec("a", blocks=11, seqs=100)
    ta, tb = TenantPolicy("ta"), TenantPolicy("tb")
    la = await store.try_admit(tenant_ask(a, ta, blocks=2))
    lb = await store.try_admit(tenant_ask(a, tb, blocks=2))
    la = await store.extend(la, 6)  # ta's request grew: 8 blocks; the engine is full
    a_ask, b_ask = tenant_ask(a, ta, queued=True), tenant_ask(a, tb, queued=True)
    for x in (a_ask, b_ask):  # ta's entry arrives first ...
        assert await store.enqueue(queue_entry(x, x.tenant), max_length=10) == "queued"
    await release_all(store, [la, lb])
    # ... but ta has been charged 8 blocks to tb's 2: tb's entry goes first.
    assert await store.try_admit(a_ask) == Refusal("queued_ahead")
    got = [await store.try_admit(b_ask), await store.try_admit(a_ask)]
    assert all(isinstance(g, Lease) for g in got), got
    await release_all(store, got)


async def test_a_dropped_group_is_forgotten_and_may_be_named_again(store):
    """`drop_group`: asks may no longer name the group (as one never set), the other
    groups are untouched, dropping one never set is no error, and it may be named again."""
    a, b = spec("a", blocks=11), spec("b", blocks=21)
    await store.set_views([EngineView(a, EngineLoad()), EngineView(b, EngineLoad())])
    await store.set_group("both", frozenset({"a", "b"}), 1.0)
    await store.set_group("only-a", frozenset({"a"}), 1.0)
    need = Footprint(4, 1, 64)

    def grouped(group):
        return AdmissionAsk(lease_id=f"lease-{next(_ids)}", group=group, need=need)

    await store.drop_group("both")
    await store.drop_group("never-set")
    with pytest.raises(KeyError):
        await store.try_admit(grouped("both"))
    held = await store.try_admit(grouped("only-a"))
    assert isinstance(held, Lease) and held.engine == "a"
    await store.set_group("both", frozenset({"a", "b"}), 1.0)
    again = await store.try_admit(grouped("both"))
    assert isinstance(again, Lease) and again.engine == "b"  # 20 free against 6
    for lease in (held, again):
        assert await store.release(lease) is True
