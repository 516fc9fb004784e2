"""What only the Redis store has: several replicas, lease expiry, pub/sub, losing Redis."""

import asyncio
import json
import random
import socket
import time
from dataclasses import replace

import pytest
import redis.asyncio as aioredis

from gateway.core.routing import Router
from gateway.core.types import DEFAULT_TENANT, EngineLoad, TenantPolicy
from gateway.harness import RedisServer
from gateway.state import redis as redis_store_module
from gateway.state.base import Lease, QueueEntry, Refusal
from gateway.state.errors import StateUnavailable
from gateway.state.fallback import FailOpenLocal
from gateway.state.memory import InMemoryStore
from gateway.state.redis import KEY_NAMES, RedisStore
from gateway.state.totals import StoreTotals
from tests.redis_server import redis_url

from .conftest import assert_clean, drop_keys, redis_store
from .tcp_proxy import TcpProxy
from .test_conformance import ask, entry, spec

pytestmark = pytest.mark.redis


@pytest.fixture
async def replicas(prefix):
    """Make stores sharing one prefix ("replicas"); at the end all must be empty and clean."""
    made: list[RedisStore] = []

    def make(replica: str, **kwargs) -> RedisStore:
        s = redis_store(prefix, replica, **kwargs)
        made.append(s)
        return s

    try:
        yield make
        checker = redis_store(prefix, "checker")
        try:
            assert await checker.totals() == StoreTotals()
        finally:
            await checker.close()
        await assert_clean(prefix)
    finally:
        for s in made:
            await s.close()
        await drop_keys(prefix)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_lease_is_recorded_with_owner_and_expiry(replicas, prefix):
    store = replicas("replica-a", lease_ttl_s=5)
    t = TenantPolicy("t", tpm=1000)
    lease = await store.try_admit(replace(ask(spec("a"), blocks=3), tenant=t, tokens=40))
    client = aioredis.from_url(redis_url())
    try:
        record = json.loads(await client.hget(f"{{{prefix}}}:leases", lease.id))
        expiry = await client.zscore(f"{{{prefix}}}:lexp", lease.id)
        now = float(".".join(str(p) for p in await client.time()))
    finally:
        await client.aclose()
    assert record["r"] == "replica-a" and record["e"] == "a" and record["t"] == "t"
    assert (record["b"], record["s"], record["k"]) == (3, 1, 40)
    assert now + 4 < expiry <= now + 5
    assert store.held == {lease.id}
    assert await store.release(lease, used_tokens=40) is True
    assert store.held == frozenset()


async def test_an_injected_clock_is_the_scripts_time(replicas, prefix):
    """Tests only (`RedisStore(clock=...)`, issue 39): every script takes the clock's time
    instead of Redis TIME: leases and entries expire by it, and without a seed the tie
    between equal engines is broken by its microseconds."""
    now = [5000.000003]
    store = replicas("replica-a", clock=lambda: now[0], seed=None, lease_ttl_s=60)
    a, b = spec("a"), spec("b")
    first = await store.try_admit(ask(a, b, blocks=3))
    assert first.engine == "b"  # 3 µs: the second of two tied candidates
    await store.release(first)
    now[0] += 1e-6
    lease = await store.try_admit(ask(a, b, blocks=3))
    assert lease.engine == "a"  # 4 µs: the first
    client = aioredis.from_url(redis_url())
    try:
        assert await client.zscore(f"{{{prefix}}}:lexp", lease.id) == now[0] + 60
    finally:
        await client.aclose()
    waiting = ask(a, blocks=3)
    assert await store.enqueue(entry(waiting, {"a"}), max_length=4) == "queued"
    now[0] += 9.9
    assert await store.queue_length() == 1
    now[0] += 0.2  # past the entry's wait (10 s)
    assert await store.queue_length() == 0
    store.stop_renewing()  # as a crashed replica: the lease is not renewed
    now[0] += 49.8
    assert (await store.totals()).leases == 1
    now[0] += 0.2  # past the lease's TTL (60 s)
    assert (await store.totals()).leases == 0


async def _script_calls(client: aioredis.Redis) -> dict[str, int]:
    stats = await client.info("commandstats")
    names = ("fcall", "evalsha", "function|load", "script|load")
    return {n: int(stats.get(f"cmdstat_{n}", {}).get("calls", 0)) for n in names}


async def _admit_and_release(store: RedisStore) -> None:
    lease = await store.try_admit(ask(spec("a"), blocks=3))
    assert isinstance(lease, Lease), lease
    assert await store.release(lease) is True


async def test_scripts_run_as_one_function_library_loaded_again_after_a_flush(replicas):
    """A store calls its scripts with FCALL; a Redis that lost the library (restarted,
    flushed) is sent it again and the call still succeeds."""
    store = replicas("replica-a")
    client = aioredis.from_url(redis_url())
    try:
        await _admit_and_release(store)
        before = await _script_calls(client)
        await _admit_and_release(store)
        after = await _script_calls(client)
        assert after["fcall"] - before["fcall"] == 2
        assert after["evalsha"] == before["evalsha"]
        await client.function_flush()
        await _admit_and_release(store)
        again = await _script_calls(client)
        assert again["function|load"] - after["function|load"] == 1
        assert again["fcall"] - after["fcall"] == 3  # the one that found none, once more, release
    finally:
        await client.aclose()


@pytest.mark.parametrize("missing", ["FCALL", "FUNCTION"])
async def test_a_redis_without_functions_is_called_with_evalsha(prefix, missing):
    """On a server without FCALL (Redis before 7.0), or that does not let the store load its
    library (here either command renamed away), the store falls back to EVALSHA at its first
    call and works as before."""
    with RedisServer(args=["--rename-command", missing, ""]) as server:
        store = RedisStore(server.url, ["most_free_blocks"], replica_id="r", key_prefix=prefix)
        client = aioredis.from_url(server.url)
        try:
            for _ in range(3):
                await _admit_and_release(store)
            calls = await _script_calls(client)
            # At most the first call tried FCALL (it found no library it could load).
            assert calls["evalsha"] >= 6 and calls["fcall"] <= 1, calls
            assert await store.totals() == StoreTotals()
        finally:
            await store.close()
            await client.aclose()


async def test_fresh_ttls_are_left_alone_and_shared_ttls_stay_equal(replicas, prefix):
    """Keys whose TTL is within 1 % of the key TTL are not set again by every call (no
    PEXPIRE while a lease keeps them alive); the headroom records and their aggregates keep
    one TTL between them."""
    store = replicas("replica-a")
    client = aioredis.from_url(redis_url())
    try:
        held = await store.try_admit(ask(spec("a", blocks=40), blocks=3))
        assert isinstance(held, Lease)

        async def pexpires() -> int:
            stats = await client.info("commandstats")
            return int(stats.get("cmdstat_pexpire", {}).get("calls", 0))

        before = await pexpires()
        for _ in range(5):
            lease = await store.try_admit(ask(spec("a", blocks=40), blocks=3))
            assert isinstance(lease, Lease)
            assert await store.release(lease) is True
        # Every key there already, its TTL fresh: none set again (the code before set 72).
        # At most one each if the machine stalled past the 1.3 s of slack meanwhile.
        assert await pexpires() - before <= len(KEY_NAMES)
        shared = [f"{{{prefix}}}:{name}" for name in ("act", "acts", "actr", "acta")]
        expiries = [await client.execute_command("PEXPIRETIME", key) for key in shared]
        present = [t for t in expiries if t > 0]  # -2: no such key (acta: nobody idle)
        assert len(present) >= 3 and max(present) - min(present) <= 2, expiries
        assert await store.release(held) is True
    finally:
        await client.aclose()


async def test_between_full_touches_a_call_reads_only_the_ttls_of_keys_it_may_have_made(
    replicas, prefix
):
    """While the TTL clock lives, a call reads the TTLs of the keys it wrote new fields or
    members to, not all 16 (the code before: 16 PTTLs per call, 32 per admit and release);
    and a key made anew meanwhile still gets its TTL, the records' keys one TTL between
    them."""
    store = replicas("replica-a")
    client = aioredis.from_url(redis_url())
    clock = f"{{{prefix}}}:touch"
    try:

        async def pttls() -> int:
            stats = await client.info("commandstats")
            return int(stats.get("cmdstat_pttl", {}).get("calls", 0))

        held = await store.try_admit(ask(spec("a", blocks=40), blocks=3))
        assert isinstance(held, Lease)
        await client.set(clock, "1", px=60_000)  # no full touch in this test's time
        before = await pttls()
        for _ in range(5):
            lease = await store.try_admit(ask(spec("a", blocks=40), blocks=3))
            assert isinstance(lease, Lease)
            assert await store.release(lease) is True
        assert await pttls() - before <= 5 * 4, "more TTLs read than keys written new"

        # The line's keys are made anew by a call that finds the clock alive (the records'
        # keys there all along): each of them gets its TTL all the same.
        line = [f"{{{prefix}}}:{name}" for name in ("q", "qent", "qexp", "qtf")]
        assert await client.exists(*line) == 0
        waiting = ask(spec("a", blocks=40), blocks=3)
        assert await store.enqueue(entry(waiting, {"a"}, 3), max_length=10) == "queued"
        assert await client.pttl(clock) > 0  # the path under test, not a full touch by expiry
        assert [await client.pttl(key) > 0 for key in line] == [True] * 4
        await assert_clean(prefix)
        await store.dequeue(waiting.lease_id)

        # Nothing held: `actr` (the tenants holding blocks) goes, and the next admission
        # makes it anew under the clock: it takes the TTL of the records' other keys.
        assert await store.release(held) is True
        shared = [f"{{{prefix}}}:{name}" for name in ("act", "acts", "actr", "acta")]
        assert await client.exists(shared[2]) == 0
        await asyncio.sleep(0.05)  # the others' TTLs now 50 ms short of the key TTL
        lease = await store.try_admit(ask(spec("a", blocks=40), blocks=3))
        assert isinstance(lease, Lease)
        assert await client.pttl(clock) > 0
        await assert_clean(prefix)
        expiries = [await client.execute_command("PEXPIRETIME", key) for key in shared]
        present = [t for t in expiries if t > 0]
        assert len(present) >= 3 and max(present) - min(present) <= 2, expiries
        assert await store.release(lease) is True
    finally:
        await client.aclose()


CAPACITY = {"a": 20, "b": 12}
CAPPED = TenantPolicy("capped", max_concurrency=4)


async def burst(stores, rng: random.Random, n: int = 200) -> int:
    """`n` concurrent requests spread over `stores`, each holding its lease a few ms.
    Asserts at every grant that no engine and no tenant is over its limit; returns how many
    were granted."""
    a, b = spec("a", blocks=21, seqs=100), spec("b", blocks=13, seqs=100)
    held = {"a": 0, "b": 0, "capped": 0}
    granted = 0

    async def one(i: int) -> None:
        nonlocal granted
        store = stores[i % len(stores)]
        tenant = CAPPED if i % 5 == 0 else DEFAULT_TENANT
        x = replace(ask(a, b, blocks=2), tenant=tenant)
        for _ in range(3):
            got = await store.try_admit(x)
            if isinstance(got, Lease):
                break
            await asyncio.sleep(rng.random() / 500)
        else:
            return
        granted += 1
        # Counted from the grant's reply until before the release is sent: within the time
        # Redis holds the lease, so any excess seen here is a real over-commit.
        held[got.engine] += got.blocks
        held["capped"] += tenant is CAPPED
        assert held[got.engine] <= CAPACITY[got.engine]
        assert held["capped"] <= CAPPED.max_concurrency
        await asyncio.sleep(rng.random() / 200)
        held[got.engine] -= got.blocks
        held["capped"] -= tenant is CAPPED
        assert await store.release(got) is True

    await asyncio.gather(*(one(i) for i in range(n)))
    return granted


async def test_replicas_never_overcommit_under_bursts(replicas):
    """200 concurrent asks over three replicas against room for 10 + 6, many trials."""
    stores = [replicas(f"replica-{i}") for i in range(3)]
    rng = random.Random(7)
    for _trial in range(12):
        assert await burst(stores, rng) >= 16
        assert await stores[0].totals() == StoreTotals()


async def test_killed_replica_leases_expire_within_ttl(replicas):
    ttl = 1.0
    doomed = replicas("doomed", lease_ttl_s=ttl)
    survivor = replicas("survivor", lease_ttl_s=ttl)
    a = spec("a", blocks=11)
    leases = [await doomed.try_admit(ask(a, blocks=5)) for _ in range(2)]
    assert all(isinstance(x, Lease) for x in leases)
    killed_at = time.monotonic()
    doomed.stop_renewing()  # SIGKILL as the others see it: nothing released, nothing renewed
    assert await survivor.try_admit(ask(a, blocks=5)) == Refusal("no_capacity")
    while (await survivor.loads()).get("a", EngineLoad()) != EngineLoad():
        # The bound leaves room for a slow machine; leases that never expire still fail it.
        assert time.monotonic() - killed_at < ttl + 1.0, "leases outlived their TTL"
        await asyncio.sleep(0.02)
    back = await survivor.try_admit(ask(a, blocks=10))
    assert isinstance(back, Lease)
    assert await survivor.release(back) is True
    assert await doomed.release(leases[0]) is False  # reaped already: release is a no-op


async def test_renewal_keeps_running_leases(replicas):
    store = replicas("replica-a", lease_ttl_s=0.4)
    lease = await store.try_admit(ask(spec("a"), blocks=2))
    await asyncio.sleep(1.2)  # three TTLs; the store renews every TTL/3
    assert (await store.loads())["a"] == EngineLoad(2, 1)
    assert await store.release(lease) is True


async def test_leases_lost_by_redis_are_written_again_by_the_renewal(replicas, prefix):
    """Redis restarted empty (it keeps nothing on disk): the requests still run on their
    engines, so the next renewal counts their blocks again, limits and all."""
    store = replicas("replica-a", lease_ttl_s=30)  # the test renews by hand
    other = replicas("replica-b", lease_ttl_s=30)
    a = spec("a", blocks=21, seqs=100)
    t = TenantPolicy("t", max_concurrency=2, tpm=1000)
    leases = [
        await store.try_admit(replace(ask(a, blocks=4), tenant=t, tokens=40)) for _ in range(2)
    ]
    assert all(isinstance(x, Lease) for x in leases)
    await drop_keys(prefix)  # what a restart does to the shared state
    assert await other.totals() == StoreTotals()

    await store.renew(leases)

    assert await other.totals() == StoreTotals(
        leases=2,
        reserved_blocks=8,
        reserved_seqs=2,
        tenant_in_flight={"t": 2},
        tenant_blocks={"t": 8},
    )
    # Another replica sees them: 12 of 20 blocks free, and the tenant at its concurrency.
    assert await other.try_admit(ask(a, blocks=13)) == Refusal("no_capacity")
    third = await other.try_admit(replace(ask(a, blocks=1), tenant=t))
    assert isinstance(third, Refusal) and third.code == "tenant_concurrency"
    for lease in leases:
        assert await store.release(lease, used_tokens=10) is True
    assert store.held == frozenset()


async def test_renewals_go_in_bounded_chunks(replicas, prefix, monkeypatch):
    """A round of many leases and entries is several short scripts, not one long one (no
    script holds Redis's one thread for long); each lease and entry is renewed, and the
    leases Redis lost are written again, whichever chunk they fall in."""
    monkeypatch.setattr(redis_store_module, "RENEW_CHUNK", 3)
    store = replicas("replica-a", lease_ttl_s=30)
    calls: list[tuple[int, int]] = []
    write = store._write_leases

    async def counted(records, entries=()):
        calls.append((len(records), len(entries)))
        return await write(records, entries)

    monkeypatch.setattr(store, "_write_leases", counted)
    a = spec("a", blocks=101, seqs=100)
    leases = [await store.try_admit(ask(a, blocks=1)) for _ in range(7)]
    hog = await store.try_admit(ask(a, blocks=100 - 7))
    waiting = [ask(a, blocks=5) for _ in range(2)]
    for w in waiting:
        assert (
            await store.enqueue(
                QueueEntry(w.lease_id, DEFAULT_TENANT, frozenset({"a"}), 5, 60.0), 10
            )
            == "queued"
        )
    await drop_keys(prefix)  # every lease lost; the entries too (not written again)
    calls.clear()
    await store._renew(
        {x.id: store._held[x.id] for x in [*leases, hog]}, [w.lease_id for w in waiting]
    )
    assert all(r + e <= 3 for r, e in calls) and len(calls) == 4, calls  # 8 leases + 2 entries
    assert sum(r for r, _ in calls) == 8 and sum(e for _, e in calls) == 2
    assert (await store.totals()).leases == 8
    for w in waiting:
        await store.dequeue(w.lease_id)
    for lease in [*leases, hog]:
        assert await store.release(lease) is True


async def test_a_lease_written_again_releases_with_a_refund_like_any_other(replicas, prefix):
    """A tenant without TPM: its record has no `tpm` (not JSON null), so the release's
    refund check passes over it, here as after admit.lua."""
    store = replicas("replica-a", lease_ttl_s=30)
    lease = await store.try_admit(replace(ask(spec("a", blocks=21), blocks=4), tokens=40))
    await drop_keys(prefix)
    await store.renew([lease])
    assert await store.release(lease, used_tokens=10) is True  # used != charged
    assert await store.loads() == {}


async def test_a_retried_extend_adds_its_blocks_once(replicas):
    """redis-py retries a call whose reply was lost: extend sends a size, not a delta."""
    store = replicas("replica-a", lease_ttl_s=30)
    lease = await store.try_admit(ask(spec("a", blocks=21), blocks=4))
    for _ in range(2):  # the same call, run twice
        assert int(await store._call("extend", [lease.id, "4", "7"])) == 7
    assert (await store.loads())["a"] == EngineLoad(7, 1)
    assert await store.release(lease) is True


async def test_an_extended_lease_is_written_again_with_its_new_size(replicas, prefix):
    store = replicas("replica-a", lease_ttl_s=30)
    lease = await store.try_admit(ask(spec("a", blocks=21), blocks=4))
    grown = await store.extend(lease, 3)
    await drop_keys(prefix)
    await store.renew([grown])
    assert (await store.loads())["a"] == EngineLoad(7, 1)
    assert await store.release(grown) is True


async def test_a_lease_released_during_its_renewal_is_not_left_behind(replicas, prefix):
    """The renewal took its snapshot, then the request ended and its release ran first:
    the lease written again by that renewal is released again, not left to expire."""
    store = replicas("replica-a", lease_ttl_s=30)
    lease = await store.try_admit(ask(spec("a"), blocks=3))
    snapshot = {lease.id: store._held[lease.id]}  # what the renewal task had taken
    await drop_keys(prefix)
    assert await store.release(lease) is False  # Redis had lost it already
    await store._renew(snapshot)  # the renewal arrives after the release
    assert await store.totals() == StoreTotals()
    assert store.held == frozenset()


async def test_flush_waits_for_a_renewal_on_its_way(replicas):
    """A renewal round took its snapshot and reaches Redis after the release: it writes the
    lease again. `flush` returns only once that round has released it again."""
    store = replicas("replica-a", lease_ttl_s=30)
    lease = await store.try_admit(ask(spec("a"), blocks=3))
    snapshot = {lease.id: store._held[lease.id]}
    released = asyncio.Event()

    async def round_on_its_way() -> None:
        async with store._renewing:
            await released.wait()
            await store._renew(snapshot)

    task = asyncio.create_task(round_on_its_way())
    await asyncio.sleep(0)  # the round holds the lock
    assert await store.release(lease) is True
    released.set()
    await store.flush()
    assert task.done()
    assert await store.totals() == StoreTotals()


async def test_a_waiter_on_one_replica_wakes_on_a_release_on_another(replicas):
    one, other = replicas("one"), replicas("other")
    lease = await one.try_admit(ask(spec("a"), blocks=2))
    waiting = ask(spec("a"), blocks=20)  # notices are for waiters: one waits in the line
    entry = QueueEntry(waiting.lease_id, DEFAULT_TENANT, frozenset({"a"}), 20, 30.0)
    assert await other.enqueue(entry, 10) == "queued"
    await other.wait_for_change(0.2)  # starts its listener (and returns on its first notice)
    await asyncio.sleep(0.1)
    waiter = asyncio.create_task(other.wait_for_change(30.0))
    await asyncio.sleep(0.05)
    while waiter.done():  # a late notice from the listener's start: wait again
        waiter = asyncio.create_task(other.wait_for_change(30.0))
        await asyncio.sleep(0.05)
    started = time.monotonic()
    await one.release(lease)
    await asyncio.wait_for(waiter, 10.0)
    assert time.monotonic() - started < 5  # woken by pub/sub, not by the 30 s timeout
    await other.dequeue(waiting.lease_id)


async def test_fair_line_is_shared_by_replicas(replicas):
    one, other = replicas("one"), replicas("other")
    a = spec("a", blocks=11)
    hog = await one.try_admit(ask(a, blocks=10))
    first = replace(ask(a, blocks=4), queued=True)
    entry = QueueEntry(first.lease_id, DEFAULT_TENANT, frozenset({"a"}), 4, 10.0)
    assert await one.enqueue(entry, 10) == "queued"
    assert await other.queue_length() == 1
    assert await other.blocks_ahead(frozenset({"a"})) == 4
    assert await other.try_admit(ask(a, blocks=1)) == Refusal("queued_ahead")
    await other.release(Lease(hog.id, "", 0, 0))  # release by id, from another replica
    got = await one.try_admit(first)
    assert isinstance(got, Lease)
    assert await one.release(got) is True


async def test_an_entry_with_its_engines_as_a_list_still_competes(replicas, prefix):
    """An entry keeps its engines as one string ('\\n' between); one written by an older
    version has a JSON list, and is still seen ahead of those wanting one of them."""
    store = replicas("one")
    client = aioredis.from_url(redis_url())
    try:
        a, b = spec("a", blocks=11), spec("b", blocks=11)
        waiting = replace(ask(a, blocks=4), queued=True)
        entry = QueueEntry(waiting.lease_id, DEFAULT_TENANT, frozenset({"a", "c"}), 4, 10.0)
        assert await store.enqueue(entry, 10) == "queued"
        key = f"{{{prefix}}}:qent"
        raw = json.loads(await client.hget(key, waiting.lease_id))
        assert raw["e"] == "a\nc"
        for form in (raw["e"], ["a", "c"]):
            await client.hset(key, waiting.lease_id, json.dumps(raw | {"e": form}))
            assert await store.blocks_ahead(frozenset({"c"})) == 4
            assert await store.blocks_ahead(frozenset({"b"})) == 0
            got = await store.try_admit(ask(a, blocks=1))
            assert isinstance(got, Refusal) and got.code == "queued_ahead", form
            lease = await store.try_admit(ask(b, blocks=1))  # wants no engine of the entry
            assert isinstance(lease, Lease), form
            assert await store.release(lease) is True
        await store.dequeue(waiting.lease_id)
    finally:
        await client.aclose()


async def test_a_dead_replicas_waiters_leave_the_line_within_ttl(replicas):
    """A waiting entry is owned by its replica and kept alive like a lease: when the replica
    dies its entries stop blocking the line and stop counting towards `max_length` within
    `lease_ttl_s`, however long their `max_wait_s`."""
    ttl = 1.0
    doomed = replicas("doomed", lease_ttl_s=ttl)
    survivor = replicas("survivor", lease_ttl_s=ttl)
    a = spec("a", blocks=11)
    waiting = [ask(a, blocks=4) for _ in range(3)]
    for w in waiting:
        entry = QueueEntry(w.lease_id, DEFAULT_TENANT, frozenset({"a"}), 4, 600.0)
        assert await doomed.enqueue(entry, max_length=3) == "queued"
    small = ask(a, blocks=1)
    assert await survivor.try_admit(small) == Refusal("queued_ahead")
    late = QueueEntry(small.lease_id, DEFAULT_TENANT, frozenset({"a"}), 1, 600.0)
    assert await survivor.enqueue(late, max_length=3) == "queue_full"
    killed_at = time.monotonic()
    doomed.stop_renewing()  # SIGKILL as the others see it
    while await survivor.queue_length() > 0:
        assert time.monotonic() - killed_at < ttl + 1.0, "dead waiters outlived the TTL"
        await asyncio.sleep(0.02)
    assert await survivor.enqueue(late, max_length=3) == "queued"
    got = await survivor.try_admit(replace(small, queued=True))
    assert isinstance(got, Lease)
    assert await survivor.release(got) is True


async def test_a_live_replicas_waiters_are_renewed_but_never_past_their_wait(replicas):
    store = replicas("replica-a", lease_ttl_s=0.4)
    a = spec("a", blocks=11)
    patient, brief = ask(a, blocks=4), ask(a, blocks=4)
    for w, wait in ((patient, 600.0), (brief, 0.6)):
        entry = QueueEntry(w.lease_id, DEFAULT_TENANT, frozenset({"a"}), 4, wait)
        assert await store.enqueue(entry, max_length=10) == "queued"
    await asyncio.sleep(1.4)  # three TTLs and more: renewed every TTL/3
    assert await store.queue_length() == 1  # `brief` reached its max_wait_s, renewed or not
    got = await store.try_admit(replace(patient, queued=True))
    assert isinstance(got, Lease)
    assert await store.queue_length() == 0
    assert await store.release(got) is True


async def test_a_small_pool_is_back_pressure_not_a_lost_redis(replicas):
    """300 concurrent calls through a pool of 5 connections: each waits for its turn, none
    is taken for an outage (redis-py's own pool raised MaxConnectionsError past its size)."""
    store = replicas("replica-a", max_connections=5)
    a = spec("a", blocks=1000, seqs=1000)
    results = await asyncio.gather(*(store.try_admit(ask(a, blocks=1)) for _ in range(300)))
    assert all(isinstance(r, Lease) for r in results)
    assert not store.degraded
    assert all(await asyncio.gather(*(store.release(r) for r in results)))
    lanes = (store._request_lane, store._background_lane)
    assert 0 < sum(lane.open for lane in lanes) <= 5 - 1  # and one for the listener


def test_the_pool_must_leave_room_for_the_request_path():
    with pytest.raises(ValueError, match="max_connections"):
        RedisStore("redis://127.0.0.1:1/0", ["most_free_blocks"], replica_id="r", max_connections=2)


# ---- losing Redis ----------------------------------------------------------------------


async def test_dequeues_kept_for_a_lost_redis_are_bounded(monkeypatch):
    """Requests that leave the line while Redis is away are dequeued again once it is back,
    but only up to `PENDING_DEQUEUES_MAX` (issue 38: memory stays bounded in a long outage
    under load; the rest expire in Redis by themselves). The cap lowered to 20 here."""
    monkeypatch.setattr(redis_store_module, "PENDING_DEQUEUES_MAX", 20)
    store = RedisStore(f"redis://127.0.0.1:{closed_port()}/0", ["most_free_blocks"], replica_id="r")
    try:
        for i in range(50):
            await store.dequeue(f"gone-{i}")  # never raises
        assert len(store._pending_dequeue) == 20
        assert store.pending == 20
        assert store._pending_dequeue == {f"gone-{i}" for i in range(20)}  # the first kept
    finally:
        await store.close()


async def test_unreachable_redis_fails_closed():
    store = RedisStore(f"redis://127.0.0.1:{closed_port()}/0", ["most_free_blocks"], replica_id="r")
    try:
        with pytest.raises(StateUnavailable) as raised:
            await store.try_admit(ask(spec("a")))
        assert raised.value.status == 503 and raised.value.code == "state_unavailable"
        # When it will try Redis again: RETRY_REDIS_AFTER_S (0.5 s) at most, whole seconds.
        assert raised.value.headers["retry-after"] == "1"
        assert 0 < int(raised.value.headers["retry-after-ms"]) <= 500
        with pytest.raises(StateUnavailable):
            await store.enqueue(QueueEntry("e", DEFAULT_TENANT, frozenset({"a"}), 1, 1.0), 5)
        with pytest.raises(StateUnavailable):
            await store.loads()
        # Calls made from `finally` blocks never raise.
        assert await store.release(Lease("unknown", "a", 1, 1)) is False
        await store.dequeue("e")
        await store.renew([Lease("unknown", "a", 1, 1)])
        await store.wait_for_change(0.05)
        assert store.degraded
    finally:
        await store.close()


def fail_open_local(shared: RedisStore, local_share: float = 0.5) -> FailOpenLocal:
    return FailOpenLocal(shared, InMemoryStore(Router(), random.Random(0)), local_share)


async def test_unreachable_redis_fail_open_local_admits_a_local_share():
    store = fail_open_local(
        RedisStore(f"redis://127.0.0.1:{closed_port()}/0", ["most_free_blocks"], replica_id="r")
    )
    try:
        a = spec("a", blocks=21, seqs=100)  # 20 blocks; locally 10
        leases = []
        while isinstance(got := await store.try_admit(ask(a, blocks=2)), Lease):
            leases.append(got)
        assert len(leases) == 5 and got == Refusal("no_capacity")
        capped = TenantPolicy("capped", max_concurrency=4)  # locally 2
        x = [await store.try_admit(replace(ask(spec("b"), blocks=1), tenant=capped)) for _ in "abc"]
        assert [type(r).__name__ for r in x] == ["Lease", "Lease", "Refusal"]
        assert await store.loads() == {"a": EngineLoad(10, 5), "b": EngineLoad(2, 2)}
        for lease in [*leases, *x[:2]]:
            assert await store.release(lease) is True
        assert await store.loads() == {}
    finally:
        await store.close()


@pytest.mark.parametrize("on_failure", ["fail_closed", "fail_open_local"])
async def test_redis_lost_and_back(prefix, on_failure):
    proxy = TcpProxy()
    await proxy.start()
    shared = RedisStore(
        proxy.url,
        ["most_free_blocks"],
        replica_id="r",
        key_prefix=prefix,
        lease_ttl_s=0.6,
        timeout_s=0.5,
    )
    store = shared if on_failure == "fail_closed" else fail_open_local(shared)
    try:
        a = spec("a", blocks=21, seqs=100)
        before = await store.try_admit(ask(a, blocks=4))
        assert isinstance(before, Lease)
        await proxy.stop()  # Redis is gone
        local = None
        if on_failure == "fail_closed":
            with pytest.raises(StateUnavailable):
                await store.try_admit(ask(a, blocks=4))
        else:
            local = await store.try_admit(ask(a, blocks=4))
            assert isinstance(local, Lease)
        # Released during the outage: accepted, retried once Redis is back.
        assert await store.release(before) is True
        await proxy.start()  # Redis is back, same address
        deadline = time.monotonic() + 5
        while True:
            try:
                await store.totals()  # only ever read from Redis
            except StateUnavailable:
                assert time.monotonic() < deadline, "did not resume"
                await asyncio.sleep(0.1)
                continue
            # Settled: the outage's release sent, the local lease handed to Redis (so that
            # neither lands between the two reads around `after` below).
            outage = store.outage if isinstance(store, FailOpenLocal) else frozenset()
            if not shared.pending and not outage:
                break
            assert time.monotonic() < deadline, (shared.pending, outage)
            await asyncio.sleep(0.05)
        totals = await store.totals()
        after = await store.try_admit(ask(a, blocks=4))
        assert isinstance(after, Lease) and not store.degraded
        assert (await store.totals()).leases == totals.leases + 1  # granted by Redis
        # The outage's release is retried; a lease granted locally is adopted by Redis.
        expected = StoreTotals(
            leases=2 if local else 1,
            reserved_blocks=8 if local else 4,
            reserved_seqs=2 if local else 1,
            tenant_in_flight={"default": 2 if local else 1},
            tenant_blocks={"default": 8 if local else 4},
        )
        adopted = local is None or local.id in shared.held  # held in Redis from now on
        while not adopted or (await store.totals()) != expected:
            assert time.monotonic() < deadline, (await store.totals(), store.held)
            await asyncio.sleep(0.05)
            adopted = local is None or local.id in shared.held
        if local is not None:
            # Another replica counts it: with `after` (4) and it (4) held, 12 of 20 are free.
            other = RedisStore(
                redis_url(), ["most_free_blocks"], replica_id="other", key_prefix=prefix
            )
            try:
                assert await other.try_admit(ask(a, blocks=13)) == Refusal("no_capacity")
            finally:
                await other.close()
            assert await store.release(local) is True
        big = await store.try_admit(ask(a, blocks=13))
        assert isinstance(big, Lease)
        assert await store.release(big) is True
        assert await store.release(after) is True
        assert await store.totals() == StoreTotals()
        await assert_clean(prefix)
    finally:
        await store.close()
        await proxy.stop()
        await drop_keys(prefix)


async def test_a_lease_released_while_its_renewal_is_on_its_way_is_not_written_again(
    replicas, prefix
):
    """A renewal round reads the leases held, then a release runs before the round's script:
    the script must not write the released lease again (its blocks, admitted to someone
    else meanwhile, would count twice: the soak at 100 engines saw engines above capacity).
    A lease Redis lost while its request runs is still written again."""
    store = replicas("replica-a", lease_ttl_s=30)
    a = spec("a", blocks=9, seqs=4)
    first = await store.try_admit(ask(a, blocks=8))
    async with store._renewing:  # a round on its way: it read the lease as held
        round_read = {first.id: dict(store._held[first.id])}
        assert await store.release(first)
    second = await store.try_admit(ask(a, blocks=8))  # the freed blocks, taken at once
    assert isinstance(second, Lease)
    assert await store._write_leases(round_read) == []  # not revived
    assert (await store.loads())["a"].reserved_blocks == 8
    # A lease Redis lost (every key gone, as after a restart) is written again, as before.
    kept = {second.id: dict(store._held[second.id])}
    await drop_keys(prefix)
    assert await store._write_leases(kept) == [second.id]
    assert (await store.loads())["a"].reserved_blocks == 8
    assert await store.release(second)
