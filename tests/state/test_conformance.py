import asyncio
import itertools

from gateway.core.routing import Candidate
from gateway.core.types import EngineLoad, EngineSpec, EngineView, Footprint
from gateway.state.base import AdmissionAsk, Lease, Refusal

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
    from gateway.state.base import DEFAULT_TENANT, QueueEntry

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
    from dataclasses import replace

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
    waiter = asyncio.create_task(store.wait_for_change(5.0))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    # Release by id alone (what a cancelled admission does) frees the real reservation.
    assert await store.release(Lease(id=lease.id, engine="", blocks=0, seqs=0)) is True
    await asyncio.wait_for(waiter, 2.0)  # woken by the release, not by the timeout
    assert (await store.loads()).get("a", EngineLoad()) == EngineLoad()
