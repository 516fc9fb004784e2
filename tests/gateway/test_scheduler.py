"""The scheduler hands back what a departed client left in the store, whatever call it left in.

A store call over the network (Redis) can take effect and then be cut short by the client's
departure before its answer arrives: the lease or queue entry exists, the scheduler never
learned of it. These tests slow the in-process store down after each call took effect, cancel
the request there, and look at what stays behind.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import replace

import pytest

from gateway.core.ledger import Foreign
from gateway.core.prefix import block_hashes
from gateway.core.retry import ReleaseRate
from gateway.core.routing import Router
from gateway.core.types import EngineLoad, EngineSpec, Footprint
from gateway.engines.pool import EnginePool
from gateway.errors import RateLimited
from gateway.scheduler import Ask, LineOutcome, Scheduler
from gateway.state.base import AdmissionAsk, Lease, QueueEntry, QueueVerdict, Refusal
from gateway.state.errors import StateUnavailable
from gateway.state.memory import InMemoryStore

ENGINE = EngineSpec("e", "http://e", frozenset({"m"}), 11, 16, 8, 2048)  # 10 usable blocks


class SlowAnswers(InMemoryStore):
    """Each admission or enqueue takes effect at once; its answer comes `delay_s` later."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(Router(), random.Random(0))
        self.delay_s = delay_s
        self.calls: list[str] = []
        self.took_effect = {"admit": asyncio.Event(), "enqueue": asyncio.Event()}

    async def try_admit(self, ask: AdmissionAsk) -> Lease | Refusal:
        result = await super().try_admit(ask)
        self.calls.append("admit")
        self.took_effect["admit"].set()
        await asyncio.sleep(self.delay_s)
        return result

    async def enqueue(self, entry: QueueEntry, max_length: int) -> QueueVerdict:
        verdict = await super().enqueue(entry, max_length)
        self.calls.append("enqueue")
        self.took_effect["enqueue"].set()
        await asyncio.sleep(self.delay_s)
        return verdict

    async def dequeue(self, entry_id: str) -> None:
        self.calls.append("dequeue")
        await super().dequeue(entry_id)

    async def release(self, lease: Lease, used_tokens: int | None = None) -> bool:
        self.calls.append("release")
        return await super().release(lease, used_tokens)


def scheduler(
    store: InMemoryStore,
    *,
    pool: EnginePool | None = None,
    max_length: int = 10,
    max_wait_s: float = 5.0,
    retry_fallback_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    tally: Tally | None = None,
) -> Scheduler:
    return Scheduler(
        store=store,
        pool=pool or EnginePool([ENGINE]),
        kv_ceiling=1.0,
        max_length=max_length,
        max_wait_s=max_wait_s,
        retry_fallback_s=retry_fallback_s,
        rate=ReleaseRate(10.0),
        clock=clock,
        tally=tally,
    )


class Tally:
    """A `LineTally` that keeps what it is told."""

    def __init__(self) -> None:
        self.told: list[LineOutcome] = []

    def left_line(self, outcome: LineOutcome) -> None:
        self.told.append(outcome)


async def until_waiting(sched: Scheduler, n: int = 1) -> None:
    for _ in range(500):
        if len(sched.waiting) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no request came to wait in the line")


def ask(blocks: int) -> Ask:
    return Ask(id=f"ask-{random.random()}", needs={"e": Footprint(blocks, 1, blocks * 16)})


async def cancel_after(store: SlowAnswers, call: str, coro: object) -> None:
    task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
    await store.took_effect[call].wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_lease_granted_as_the_client_left_is_released():
    store = SlowAnswers(delay_s=0.5)
    await cancel_after(store, "admit", scheduler(store).admit(ask(4)))
    assert await store.loads() == {}


async def test_a_queue_entry_made_as_the_client_left_is_removed():
    store = SlowAnswers(delay_s=0.0)
    sched = scheduler(store)
    held = await sched.admit(ask(8))  # the engine is full for the next one: it queues
    store.delay_s = 0.5
    await cancel_after(store, "enqueue", sched.admit(ask(8)))
    assert await store.queue_length() == 0
    await sched.release(held)
    assert await store.loads() == {}


async def test_a_refusal_at_once_costs_no_clean_up_calls():
    """The clean-up is for calls cut short; a request refused on its first try (here: the
    queue is full) leaves nothing behind and costs no more store calls."""
    store = SlowAnswers(delay_s=0.0)
    sched = scheduler(store)
    sched.max_length = 0
    held = await sched.admit(ask(8))
    calls = len(store.calls)
    with pytest.raises(RateLimited):
        await sched.admit(ask(8))
    assert store.calls[calls:] == ["admit", "enqueue"]
    assert await store.queue_length() == 0
    await sched.release(held)


async def test_a_queue_entry_whose_answer_was_lost_is_removed():
    """Redis ran the enqueue but its answer timed out (StateUnavailable): the entry exists
    and would head the line until it expired; the scheduler hands it back."""

    class LostAnswer(SlowAnswers):
        async def enqueue(self, entry: QueueEntry, max_length: int) -> QueueVerdict:
            await super().enqueue(entry, max_length)
            raise StateUnavailable("no answer from redis")

    store = LostAnswer(delay_s=0.0)
    sched = scheduler(store)
    held = await sched.admit(ask(8))
    with pytest.raises(StateUnavailable):
        await sched.admit(ask(8))
    assert await store.queue_length() == 0
    await sched.release(held)


async def test_a_waiter_past_half_its_wait_takes_no_staged_slot() -> None:
    # One slot and one staged. A waiter past half of max_wait_s would wait inside the engine
    # behind the running sequence: it waits in the line for the slot itself instead.
    now = [0.0]
    store = InMemoryStore(Router(), random.Random(0), clock=lambda: now[0])
    one = EngineSpec("e", "http://e", frozenset({"m"}), 11, 16, 1, 2048)
    sched = scheduler(
        store, pool=EnginePool([one], staged_seqs=1), max_wait_s=10.0, clock=lambda: now[0]
    )
    running = await sched.admit(ask(2))
    staged = await sched.admit(ask(2))  # a newcomer may be staged
    waiter = asyncio.ensure_future(sched.admit(ask(2)))
    await asyncio.sleep(0.05)
    assert not waiter.done()  # both slots taken
    now[0] = 6.0  # past half of its 10 s
    await sched.release(staged)  # a staged slot is free, the running sequence is not
    await asyncio.sleep(0.4)  # a change notice and a poll
    assert not waiter.done()
    await sched.release(running)
    lease = await asyncio.wait_for(waiter, 2.0)
    assert isinstance(lease, Lease)
    await sched.release(lease)


async def test_a_cancelled_waiter_leaves_the_line_at_once():
    """In-process, a waiter's entry lives exactly as long as its waiting request (the
    process that owns it is the store's): a client that leaves takes its entry along, so
    it blocks nobody behind it, whatever its `max_wait_s`."""
    store = SlowAnswers(delay_s=0.0)
    sched = scheduler(store)
    sched.max_wait_s = 600.0
    held = await sched.admit(ask(8))
    gone = asyncio.ensure_future(sched.admit(ask(8)))
    await store.took_effect["enqueue"].wait()
    store.took_effect["enqueue"].clear()
    behind = asyncio.ensure_future(sched.admit(ask(2)))
    await store.took_effect["enqueue"].wait()
    assert await store.queue_length() == 2
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    # Admitted at once (2 blocks are free and nobody is ahead now), without any release.
    lease = await asyncio.wait_for(behind, 5.0)
    assert await store.queue_length() == 0
    await sched.release(lease)
    await sched.release(held)
    assert await store.loads() == {}


async def test_a_waiter_kept_out_by_foreign_load_asks_for_fresh_figures_and_takes_them() -> None:
    s = scheduler(InMemoryStore(Router(), random.Random(0)))
    state = s.pool.get("e")
    assert state is not None
    state.foreign = Foreign(seqs=1, blocks=10)  # a direct client's, as last scraped
    assert not await s.pool.fresh_wanted(0.0)
    waiting = asyncio.ensure_future(s.admit(ask(2)))
    assert await s.pool.fresh_wanted(5.0)  # the waiter asked the monitor for a scrape
    assert not waiting.done()
    s.pool.probing()  # the monitor's round that answers the ask
    state.foreign = Foreign()  # the scrape: the direct client is gone
    lease = await asyncio.wait_for(waiting, 5.0)  # its next re-check reads it
    assert lease.engine == "e" and lease.blocks == 2


async def test_an_ask_made_during_a_round_is_kept_for_the_next() -> None:
    pool = EnginePool([ENGINE])
    state = pool.get("e")
    assert state is not None
    state.foreign = Foreign(seqs=1, blocks=0)
    assert pool.want_fresh(["e"])
    pool.probing()
    assert not await pool.fresh_wanted(0.0)  # answered by the round under way
    assert pool.want_fresh(["e"])  # asked again during it: for the next one
    assert await pool.fresh_wanted(0.0)


def test_only_foreign_load_on_a_healthy_engine_asks_for_fresh_figures() -> None:
    pool = EnginePool([ENGINE])
    assert not pool.want_fresh(["e", "unknown"])  # nothing foreign: releases will tell
    state = pool.get("e")
    assert state is not None
    state.foreign = Foreign(seqs=0, blocks=3)
    assert pool.want_fresh(["e"])
    pool.probing()
    pool.mark_unhealthy("e", "down", retry_at=0.0)  # its figures are unknown, not stale
    state.foreign = Foreign(seqs=0, blocks=3)  # as if left over: the health check decides
    assert not pool.want_fresh(["e"])


async def test_a_retry_finds_the_place_its_advice_promised() -> None:
    # A line of one: a request refused for a full line is told when to come back, and its
    # place is kept until then; a newcomer arriving meanwhile is refused although the line
    # has emptied, and the retry, back when told, waits in line instead of being refused
    # again.
    now = [0.0]
    store = InMemoryStore(Router(), random.Random(0), clock=lambda: now[0])
    sched = scheduler(
        store, max_length=1, max_wait_s=600.0, retry_fallback_s=2.0, clock=lambda: now[0]
    )
    held = await sched.admit(ask(8))
    waiter = asyncio.ensure_future(sched.admit(ask(8)))
    await asyncio.sleep(0.05)
    assert await store.queue_length() == 1
    with pytest.raises(RateLimited) as refused:
        await sched.admit(ask(8))
    assert refused.value.code == "queue_full"
    advised = refused.value.retry.seconds
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert await store.queue_length() == 0
    now[0] = advised / 2
    with pytest.raises(RateLimited) as newcomer:
        await sched.admit(ask(8))
    assert newcomer.value.code == "queue_full"  # the place is the retry's
    assert "1 of its places kept for retries it advised earlier" in newcomer.value.message
    now[0] = advised
    retry = asyncio.ensure_future(sched.admit(ask(8)))
    await asyncio.sleep(0.05)
    assert not retry.done() and await store.queue_length() == 1  # waiting in line
    await sched.release(held)
    lease = await asyncio.wait_for(retry, 2.0)
    await sched.release(lease)


async def test_the_scheduler_asks_on_the_requests_engines_and_the_store_keeps_their_group() -> None:
    """The scheduler names no engine group: it sends the request's engine set with its
    common footprint and the engines where it differs (`AdmissionAsk.engines`); the store
    keeps a group of the set (tests/state/test_group_cache.py)."""
    specs = [EngineSpec(n, f"http://{n}", frozenset({"m"}), 101, 16, 8, 4096) for n in "ab"]
    seen: list[AdmissionAsk] = []

    class Recording(InMemoryStore):
        async def try_admit(self, ask_: AdmissionAsk) -> Lease | Refusal:
            seen.append(ask_)
            return await super().try_admit(ask_)

    store = Recording(Router(), random.Random(0))
    sched = scheduler(store, pool=EnginePool(specs))
    need, other = Footprint(4, 1, 64), Footprint(6, 1, 96)  # b: another block size, say
    lease = await sched.admit(Ask(id="x", needs={"a": need, "b": other}))
    (asked,) = seen
    assert (asked.engines, asked.group, asked.candidates) == (frozenset("ab"), None, ())
    assert (asked.need, asked.exceptions) in ((need, (("b", other),)), (other, (("a", need),)))
    assert frozenset("ab") in store.groups
    await sched.release(lease)


async def test_each_stay_in_the_line_is_told_once_as_it_ends_by_how_it_ended() -> None:
    """Admitted at once or refused at once (the line full): never waited, nothing told.
    Waited, then: refused (queue_timeout; a refusal of the store's), abandoned (the client
    left), failed (any other error), admitted (capacity freed)."""

    class Failing(InMemoryStore):
        fail: Exception | None = None

        async def try_admit(self, ask_: AdmissionAsk) -> Lease | Refusal:
            if ask_.queued and self.fail is not None:
                raise self.fail
            return await super().try_admit(ask_)

    store = Failing(Router(), random.Random(0))
    tally = Tally()
    sched = scheduler(store, max_length=0, max_wait_s=0.2, tally=tally)
    held = await sched.admit(ask(8))
    with pytest.raises(RateLimited) as full:
        await sched.admit(ask(8))
    assert full.value.code == "queue_full" and tally.told == []
    sched.max_length = 10
    with pytest.raises(RateLimited) as timed_out:
        await sched.admit(ask(8))
    assert timed_out.value.code == "queue_timeout"
    assert tally.told == ["refused"]
    sched.max_wait_s = 600.0
    store.fail = StateUnavailable("redis is gone")
    with pytest.raises(StateUnavailable):
        await sched.admit(ask(8))
    store.fail = RuntimeError("a bug")
    with pytest.raises(RuntimeError):
        await sched.admit(ask(8))
    store.fail = None
    assert tally.told == ["refused", "refused", "failed"]
    gone = asyncio.ensure_future(sched.admit(ask(8)))
    await until_waiting(sched)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert tally.told[3:] == ["abandoned"]
    waiter = asyncio.ensure_future(sched.admit(ask(8)))
    await until_waiting(sched)
    await sched.release(held)
    lease = await asyncio.wait_for(waiter, 2.0)
    assert tally.told == ["refused", "refused", "failed", "abandoned", "admitted"]
    assert sched.waiting == {} and await store.queue_length() == 0
    await sched.release(lease)
    assert await store.loads() == {}


@pytest.mark.parametrize("caching", [True, False])
async def test_prefix_credit_goes_only_to_an_engine_that_caches_as_seen_at_each_decision(
    caching: bool,
) -> None:
    """An ask built while its engine cached prefixes (a request waiting when a scrape saw
    the engine restarted with caching off) is credited only if the engine still caches at
    the decision; the lease credited before is made whole first (issue 37)."""
    pool = EnginePool([replace(ENGINE, prefix_caching=True)])  # 10 usable blocks
    store = InMemoryStore(Router(), random.Random(0))
    sched = scheduler(store, pool=pool, max_wait_s=0.3)
    prefix = tuple(block_hashes(list(range(64)), 16))  # 4 blocks
    first = await sched.admit(Ask("first", {"e": Footprint(6, 1, 96, 6, prefix)}))
    second = Ask("second", {"e": Footprint(7, 1, 112, 7, prefix)})
    if caching:
        lease = await sched.admit(second)  # 3 more blocks with the credit of 4: fits
        assert (lease.blocks, lease.credit) == (3, 4)
        assert (await store.loads())["e"].reserved_blocks == 9
        await sched.release(lease)
    else:
        pool.update_spec("e", "discovered:/metrics", prefix_caching=False)
        with pytest.raises(RateLimited) as refused:  # 7 on 4 free: it waits, then times out
            await sched.admit(second)
        assert refused.value.code == "queue_timeout"
        assert (await store.loads())["e"].reserved_blocks == 6  # the second never got in
    await sched.release(first)
    assert (await store.loads()).get("e") in (None, EngineLoad())


# The deadline gate (issue 40): asked before each decision; the store sees only the engines
# it leaves, waits while it says Wait, and a request it finds unattainable is refused at once.

TWO = (
    EngineSpec("a", "http://a", frozenset({"m"}), 11, 16, 8, 2048),
    EngineSpec("b", "http://b", frozenset({"m"}), 11, 16, 8, 2048),
)


def gated_ask(gate, blocks=2):
    needs = {e.name: Footprint(blocks, 1, blocks * 16) for e in TWO}
    return Ask(id=f"g-{random.random()}", needs=needs, gate=gate, targeted=True)


async def test_the_store_sees_only_the_engines_the_gate_leaves():
    from gateway.core.deadline import Eligible

    store = InMemoryStore(Router(), random.Random(0))
    s = scheduler(store, pool=EnginePool(list(TWO)))
    seen = []

    def gate(waited_s):
        seen.append(waited_s)
        return Eligible(frozenset({"b"}))

    leases = [await s.admit(gated_ask(gate)) for _ in range(3)]
    assert {lease.engine for lease in leases} == {"b"}  # "a" had as much room: not asked
    assert len(seen) == 3 and all(0.0 <= w < 0.1 for w in seen)  # at once, from arrival


async def test_waits_while_the_gate_says_wait_then_goes():
    from gateway.core.deadline import Eligible, Wait

    store = InMemoryStore(Router(), random.Random(0))
    s = scheduler(store, pool=EnginePool(list(TWO)))
    calls = []

    def gate(waited_s):
        calls.append(waited_s)
        return Wait(5.0) if len(calls) < 3 else Eligible(frozenset({"a"}))

    lease = await asyncio.wait_for(s.admit(gated_ask(gate)), 5)
    assert lease.engine == "a" and len(calls) == 3
    assert 0.0 <= calls[0] < 0.1 and calls[1] > calls[0] and calls[2] >= calls[1]
    assert await store.queue_length() == 0 and s.targeted_waiting == 0


async def test_unattainable_is_refused_at_once_with_its_code():
    from gateway.core.deadline import Unattainable

    store = InMemoryStore(Router(), random.Random(0))
    s = scheduler(store, pool=EnginePool(list(TWO)))
    started = time.monotonic()
    with pytest.raises(RateLimited) as e:
        await s.admit(gated_ask(lambda waited: Unattainable(1.4, 1.0)))
    assert e.value.code == "slo_unattainable"
    assert "1.4 s" in str(e.value) and int(e.value.headers["retry-after"]) >= 1
    assert time.monotonic() - started < 1.0  # not after waiting
    assert await store.queue_length() == 0


async def test_a_waiting_request_is_refused_when_its_deadline_is_gone():
    from gateway.core.deadline import Unattainable, Wait

    store = InMemoryStore(Router(), random.Random(0))
    s = scheduler(store, pool=EnginePool(list(TWO)), max_wait_s=30.0)

    def gate(waited_s):
        return Wait(0.2 - waited_s) if waited_s < 0.2 else Unattainable(0.1, 0.3 - waited_s)

    started = time.monotonic()
    with pytest.raises(RateLimited) as e:
        await s.admit(gated_ask(gate))
    assert e.value.code == "slo_unattainable"
    assert 0.2 <= time.monotonic() - started < 2.0  # at its deadline, not max_wait_s
    assert await store.queue_length() == 0 and s.targeted_waiting == 0


async def test_refused_at_once_when_the_line_ahead_outlasts_its_deadline():
    """Three requests with targets wait; engines take about 2 a second: a fourth with 0.5 s
    left of its TTFT target would wait ~2 s for its turn, so it is refused at once."""
    from gateway.core.deadline import Wait

    store = InMemoryStore(Router(), random.Random(0))
    s = scheduler(store, pool=EnginePool(list(TWO)), max_wait_s=30.0)
    now = time.monotonic()
    for i in range(10):  # releases seen over the last 5 s: 2 sequences a second
        s.rate.record(now - 5 + i * 0.5, blocks=2, seqs=1)
    waiting = [asyncio.create_task(s.admit(gated_ask(lambda w: Wait(30.0)))) for _ in range(3)]
    for _ in range(100):
        if s.targeted_waiting == 3:
            break
        await asyncio.sleep(0.01)
    assert s.targeted_waiting == 3
    started = time.monotonic()
    with pytest.raises(RateLimited) as e:
        await s.admit(gated_ask(lambda w: Wait(0.5)))
    assert e.value.code == "slo_unattainable" and "3 requests" in str(e.value)
    assert time.monotonic() - started < 0.5
    # With 2 s left it may make it: it waits (here until it is cancelled).
    hopeful = asyncio.create_task(s.admit(gated_ask(lambda w: Wait(2.5))))
    await asyncio.sleep(0.2)
    assert not hopeful.done()
    for t in (*waiting, hopeful):
        t.cancel()
    await asyncio.gather(*waiting, hopeful, return_exceptions=True)
    assert s.targeted_waiting == 0 and await store.queue_length() == 0


async def test_a_waiting_request_is_refused_once_its_turn_cannot_come_in_time():
    """Two requests with targets wait ahead; engines take about 2 a second, so its turn
    comes in ~1.5 s. It can wait 2.5 s at the load the engines are under when it arrives
    (it waits), less and less as it waits: refused as soon as that is under its turn,
    long before an idle engine's bound (`for_s` 10 s) or `max_wait_s` (30 s)."""
    from gateway.core.deadline import Wait

    store = InMemoryStore(Router(), random.Random(0))
    s = scheduler(store, pool=EnginePool(list(TWO)), max_wait_s=30.0)
    now = time.monotonic()
    for i in range(10):  # releases seen over the last 5 s: 2 sequences a second
        s.rate.record(now - 5 + i * 0.5, blocks=2, seqs=1)
    ahead = [asyncio.create_task(s.admit(gated_ask(lambda w: Wait(30.0)))) for _ in range(2)]
    for _ in range(100):
        if s.targeted_waiting == 2:
            break
        await asyncio.sleep(0.01)
    started = time.monotonic()
    with pytest.raises(RateLimited) as e:
        await s.admit(gated_ask(lambda w: Wait(10.0 - w, likely_s=2.5 - w)))
    took = time.monotonic() - started
    assert e.value.code == "slo_unattainable" and "2 requests" in str(e.value)
    assert 0.9 <= took < 3.0  # after waiting ~1 s (2.5 - 1.5), not 10 s nor 30 s
    assert s.targeted_waiting == 2  # it left the line; those ahead still wait
    for t in ahead:
        t.cancel()
    await asyncio.gather(*ahead, return_exceptions=True)
    assert s.targeted_waiting == 0 and await store.queue_length() == 0


async def test_the_gate_counts_the_wait_from_the_requests_arrival():
    from gateway.core.deadline import Eligible

    store = InMemoryStore(Router(), random.Random(0))
    s = scheduler(store, pool=EnginePool(list(TWO)))
    seen = []

    def gate(waited_s):
        seen.append(waited_s)
        return Eligible(frozenset({"a"}))

    ask = replace(gated_ask(gate), since_s=0.7)  # at the gateway for 0.7 s already
    await s.admit(ask)
    assert 0.7 <= seen[0] < 0.8
