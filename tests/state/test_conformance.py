import asyncio
import itertools

from gateway.core.routing import Candidate
from gateway.core.types import EngineLoad, EngineSpec, EngineView, Footprint
from gateway.state.base import AdmissionAsk

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
    assert lease is not None and (lease.engine, lease.blocks, lease.seqs) == ("a", 3, 1)
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
    assert all(held)
    assert await store.try_admit(ask(a, blocks=1)) is None  # seqs exhausted (2 of 2)
    await store.release(held[0])
    assert await store.try_admit(ask(a, blocks=6)) is None  # 5 free blocks
    small = await store.try_admit(ask(a, blocks=5))
    assert small is not None
    for lease in (held[1], small):
        await store.release(lease)


async def test_ceiling_and_health_respected(store):
    a = spec("a", blocks=11)
    assert await store.try_admit(ask(a, blocks=6, ceiling=0.5)) is None  # 5 of 10 allowed
    lease = await store.try_admit(ask(a, blocks=5, ceiling=0.5))
    assert lease is not None
    await store.release(lease)
    assert await store.try_admit(ask(a, blocks=1, healthy=False)) is None


async def test_concurrent_admissions_never_overcommit(store):
    a, b = spec("a", blocks=11, seqs=100), spec("b", blocks=7, seqs=100)
    results = await asyncio.gather(*(store.try_admit(ask(a, b, blocks=3)) for _ in range(50)))
    leases = [lease for lease in results if lease is not None]
    by_engine = {"a": 0, "b": 0}
    for lease in leases:
        by_engine[lease.engine] += lease.blocks
    assert by_engine["a"] <= 10 and by_engine["b"] <= 6
    assert len(leases) == 3 + 2  # 10 // 3 + 6 // 3
    await asyncio.gather(*(store.release(lease) for lease in leases))
