"""Prefix credit in the stores (issue 15), on every backend: a footprint is credited with the
leading prefix blocks live leases on its engine hold, and the ledger counts each held block
once, until the last lease holding it ends."""

import asyncio
import random
from dataclasses import replace

import pytest
import redis.asyncio as aioredis

from gateway.core.prefix import block_hashes
from gateway.core.routing import Candidate, Router
from gateway.core.types import EngineLoad, EngineView, Footprint
from gateway.state.base import AdmissionAsk, Lease, Refusal
from gateway.state.memory import InMemoryStore
from tests.redis_server import redis_url
from tests.state.conftest import drop_keys, new_prefix, redis_store
from tests.state.test_conformance import spec

BLOCK = 16
_n = iter(range(10**9))


def chain(*blocks: int) -> tuple[bytes, ...]:
    """Block hashes of a prompt made of blocks of the given token values (one value per
    block): equal leading values, equal leading hashes."""
    ids = [v for b in blocks for v in [b] * BLOCK]
    return tuple(block_hashes(ids, BLOCK))


def need(total: int, prefix: tuple[bytes, ...] = (), prompt: int | None = None) -> Footprint:
    return Footprint(
        blocks=total,
        seqs=1,
        tokens=total * BLOCK,
        prompt_blocks=total if prompt is None else prompt,
        prefix=prefix,
    )


def prefixed(*engines_needs: tuple, cached: int = 0) -> AdmissionAsk:
    cands = tuple(
        Candidate(EngineView(e, EngineLoad()), replace(n, cached=cached)) for e, n in engines_needs
    )
    return AdmissionAsk(lease_id=f"pfx-{next(_n)}", candidates=cands, kv_ceiling=1.0)


async def blocks_on(store, name: str) -> EngineLoad:
    return (await store.loads()).get(name, EngineLoad())


async def test_a_held_prefix_is_credited_and_counted_once_until_its_last_holder_ends(store):
    a = spec("a", blocks=101, seqs=10)
    p = chain(1, 2, 3, 4)
    first = await store.try_admit(prefixed((a, need(6, p))))
    assert isinstance(first, Lease) and (first.blocks, first.credit) == (6, 0), first
    second = await store.try_admit(prefixed((a, need(7, p))))
    assert isinstance(second, Lease) and (second.blocks, second.credit) == (3, 4), second
    assert second.prefix == p and second.prompt_blocks == 3
    assert await blocks_on(store, "a") == EngineLoad(6 + 3, 2, 6 + 3)
    # The first holder ends: the shared 4 blocks stay charged for the second.
    assert await store.release(first)
    assert await blocks_on(store, "a") == EngineLoad(7, 1, 7)
    assert await store.release(second)
    assert await blocks_on(store, "a") == EngineLoad()


async def test_only_the_leading_held_blocks_are_credited(store):
    a = spec("a", blocks=101, seqs=10)
    held = await store.try_admit(prefixed((a, need(5, chain(1, 2, 3)))))
    assert isinstance(held, Lease)
    # Shares the first two blocks, then differs: credit 2, whatever follows.
    other = await store.try_admit(prefixed((a, need(6, chain(1, 2, 9, 3)))))
    assert isinstance(other, Lease) and other.credit == 2 and other.blocks == 4, other
    # A different first block: nothing is shared (a hit is a prefix).
    third = await store.try_admit(prefixed((a, need(4, chain(7, 2, 3)))))
    assert isinstance(third, Lease) and third.credit == 0 and third.blocks == 4, third
    assert (await blocks_on(store, "a")).reserved_blocks == 5 + 4 + 4
    for lease in (other, held, third):
        assert await store.release(lease)
    assert await blocks_on(store, "a") == EngineLoad()


async def test_credit_is_per_engine_and_lets_a_request_fit_where_it_is_held(store):
    a, b = spec("a", blocks=11, seqs=10), spec("b", blocks=11, seqs=10)  # 10 blocks each
    p = chain(1, 2, 3, 4, 5, 6)
    filler = await store.try_admit(prefixed((b, need(5))))
    holder = await store.try_admit(prefixed((a, need(8, p))))
    assert isinstance(filler, Lease) and isinstance(holder, Lease) and holder.engine == "a"
    # 8 blocks fit on neither engine as such (2 and 5 free), but 6 of them are held on a.
    ask = prefixed((a, need(8, p)), (b, need(8, p)))
    got = await store.try_admit(ask)
    assert isinstance(got, Lease) and (got.engine, got.blocks, got.credit) == ("a", 2, 6), got
    assert await blocks_on(store, "a") == EngineLoad(10, 2, 10)
    # Nothing of the prefix is held on b: there it costs all of it.
    assert await store.try_admit(prefixed((b, need(8, p)))) == Refusal("no_capacity")
    for lease in (got, holder, filler):
        assert await store.release(lease)


@pytest.mark.parametrize("seed", [1, 2])
async def test_the_ledger_is_private_blocks_plus_distinct_held_prefix_blocks(store, seed):
    """Random admissions and releases of prompts from a small tree of prefixes: after every
    step the engine's reserved blocks are what the live leases hold, counting each held
    prefix block once."""
    rng = random.Random(seed)
    a = spec("a", blocks=10_001, seqs=10_000)
    live: list[tuple[Lease, tuple[bytes, ...], int]] = []
    for _ in range(60):
        if live and rng.random() < 0.4:
            lease, _, _ = live.pop(rng.randrange(len(live)))
            assert await store.release(lease)
        else:
            blocks = [rng.choice([1, 2]) for _ in range(rng.randint(0, 4))]
            p = chain(*blocks)
            total = len(p) + rng.randint(1, 3)
            lease = await store.try_admit(prefixed((a, need(total, p))))
            assert isinstance(lease, Lease), lease
            live.append((lease, p, total))
        private = sum(total - len(p) for _, p, total in live)
        distinct = len({h for _, p, _ in live for h in p})
        load = await blocks_on(store, "a")
        assert load.reserved_blocks == private + distinct, (load, live)
        assert load.prompt_blocks == private + distinct
    for lease, _, _ in live:
        assert await store.release(lease)
    assert await blocks_on(store, "a") == EngineLoad()


@pytest.mark.parametrize("backend", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
@pytest.mark.parametrize("weight", [1.0, 0.0])
async def test_most_free_after_prefers_the_engine_expected_to_cache_the_prefix(backend, weight):
    """Two empty engines, b expected to cache 6 of the prompt's 8 blocks (the replica's
    index): most_free_after goes to b (100 - 8 + 6 = 98 against 92 on a). The second, credited
    on b with the 6 blocks the first holds, costs 2 there: 92 - 2 + 6 = 96 against a's 92.
    With a cached block worth nothing (weight 0) only the memory saved counts: the first is
    a tie (92 each), and the second goes to the other engine (90 where the first holds the
    prefix, against 92)."""
    a, b = spec("a", blocks=101, seqs=10), spec("b", blocks=101, seqs=10)
    p = chain(1, 2, 3, 4, 5, 6)
    key = new_prefix()
    scorers = ["most_free_after", "fewest_running"]
    if backend == "memory":
        store = InMemoryStore(Router(scorers, cached_block_weight=weight), random.Random(0))
    else:
        store = redis_store(key, cached_block_weight=weight)
        store.scorers = tuple(scorers)
    try:
        got = []
        for _ in range(2):
            cands = (
                Candidate(EngineView(a, EngineLoad()), need(8, p)),
                Candidate(EngineView(b, EngineLoad()), replace(need(8, p), cached=6)),
            )
            got.append(
                await store.try_admit(
                    AdmissionAsk(lease_id=f"mfa-{next(_n)}", candidates=cands, kv_ceiling=1.0)
                )
            )
        engines = [g.engine for g in got if isinstance(g, Lease)]
        if weight > 0:
            assert engines == ["b", "b"], got
        else:
            assert len(engines) == 2 and engines[1] != engines[0], got
        for g in got:
            assert isinstance(g, Lease) and await store.release(g)
    finally:
        await store.close()
        if backend == "redis":
            await drop_keys(key)


@pytest.mark.redis
async def test_replicas_share_the_held_prefixes_and_an_expired_lease_lets_go_of_its_own():
    """Replica B is credited with what replica A's lease holds; A dies: its lease expires,
    and the shared blocks stay charged for B's lease alone (then go with it)."""
    key = new_prefix()
    a_store = redis_store(key, "replica-a", lease_ttl_s=0.6)
    b_store = redis_store(key, "replica-b", lease_ttl_s=30)
    a = spec("a", blocks=101, seqs=10)
    p = chain(1, 2, 3, 4)
    try:
        first = await a_store.try_admit(prefixed((a, need(6, p))))
        second = await b_store.try_admit(prefixed((a, need(7, p))))
        assert isinstance(first, Lease) and isinstance(second, Lease)
        assert second.credit == 4 and await blocks_on(b_store, "a") == EngineLoad(9, 2, 9)
        a_store.stop_renewing()  # a crash: nothing released, nothing renewed
        deadline = asyncio.get_running_loop().time() + 5
        while (await blocks_on(b_store, "a")).reserved_seqs != 1:
            assert asyncio.get_running_loop().time() < deadline, "A's lease never expired"
            await asyncio.sleep(0.05)
        assert await blocks_on(b_store, "a") == EngineLoad(7, 1, 7)
        assert await b_store.release(second)
        assert await blocks_on(b_store, "a") == EngineLoad()
        assert await fields(key, "pfx") == {}
    finally:
        await a_store.close()
        await b_store.close()
        await drop_keys(key)


@pytest.mark.redis
async def test_leases_lost_by_redis_hold_their_prefixes_again_when_written_again():
    key = new_prefix()
    store = redis_store(key, "replica-a", lease_ttl_s=30)
    a = spec("a", blocks=101, seqs=10)
    p = chain(1, 2, 3)
    try:
        leases = [await store.try_admit(prefixed((a, need(5, p)))) for _ in range(2)]
        assert [x.credit for x in leases if isinstance(x, Lease)] == [0, 3]
        await drop_keys(key)  # what a restart does to the shared state
        await store.renew(leases)  # type: ignore[arg-type]
        assert await blocks_on(store, "a") == EngineLoad(5 + 2, 2, 5 + 2)
        assert len(await fields(key, "pfx")) == 3
        for lease in leases:
            assert isinstance(lease, Lease) and await store.release(lease)
        assert await blocks_on(store, "a") == EngineLoad()
        assert await fields(key, "pfx") == {}
    finally:
        await store.close()
        await drop_keys(key)


async def fields(key: str, name: str) -> dict:
    client = aioredis.from_url(redis_url())
    try:
        return await client.hgetall(f"{{{key}}}:{name}")
    finally:
        await client.aclose()


async def test_leases_credited_on_an_engine_that_stops_caching_are_made_whole_once(store):
    """An engine seen restarted with prefix caching off (issue 37): the blocks its credited
    leases counted as another lease's are theirs alone there now, so the store counts them
    again when it is given the view, before it decides on that engine; once per lease, and
    only on that engine."""
    a = replace(spec("a", blocks=101, seqs=10), prefix_caching=True)
    b = replace(spec("b", blocks=101, seqs=10), prefix_caching=True)
    await store.set_views([EngineView(a, EngineLoad()), EngineView(b, EngineLoad())])
    p = chain(1, 2, 3, 4)
    first = await store.try_admit(prefixed((a, need(6, p))))
    second = await store.try_admit(prefixed((a, need(7, p))))
    on_b = [await store.try_admit(prefixed((b, need(5, p)))) for _ in range(2)]
    assert isinstance(second, Lease) and second.credit == 4, second
    assert (await blocks_on(store, "a")).reserved_blocks == 6 + 3
    assert (await blocks_on(store, "b")).reserved_blocks == 5 + 1
    off = replace(a, prefix_caching=False)
    await store.set_views([EngineView(off, EngineLoad())])
    assert (await blocks_on(store, "a")).reserved_blocks == 6 + 7  # made whole
    assert (await blocks_on(store, "b")).reserved_blocks == 5 + 1  # still caches
    # Caching on and off again (another restart): nothing is counted twice.
    await store.set_views([EngineView(a, EngineLoad())])
    await store.set_views([EngineView(off, EngineLoad())])
    assert (await blocks_on(store, "a")).reserved_blocks == 6 + 7
    assert await store.release(second)
    assert (await blocks_on(store, "a")).reserved_blocks == 6
    for lease in (first, *on_b):
        assert await store.release(lease)
    assert await blocks_on(store, "a") == EngineLoad()
