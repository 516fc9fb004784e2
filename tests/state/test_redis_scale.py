"""Admission at scale (issue 14): the Redis admit script's work per decision does not grow
with tenants or waiting requests.

The work is counted, not timed: the Redis commands one `try_admit` runs, read from the
server's own `INFO commandstats` before and after it (every command a script calls is
counted there, whatever the script does; the one EVALSHA is checked, so nothing else ran in
between). At 10,000 tenants (each admitted an 8-block lease, every second one released
again: all active) and 1,000 waiting it must stay within 2x of the count at 10 tenants and
10 waiting, behind the line (refused `queued_ahead`) and admitted once the line is empty.
(The scripts before issue 14 visited every active tenant: 58 and 83 commands per admission
at 10 and 10, 25,033 and 25,058 here; these: 37 and 63, then 38 and 63.)

The tenants are set up quickly, the same way for any version of the scripts: admitted and
queued with headroom off (no records), then their headroom records (`act`, as common.lua
documents it) written in one pipeline; the first decision then counts them (common.lua
`rebuild`, once) and is not measured.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.core.routing import Candidate
from gateway.core.types import EngineLoad, EngineSpec, EngineView, Footprint, TenantPolicy
from gateway.state.base import AdmissionAsk, Lease, QueueEntry
from tests.redis_server import redis_url
from tests.state.conftest import drop_keys, new_prefix, redis_store

pytestmark = pytest.mark.redis

ENGINES = 4
WINDOW_S = 600.0  # nobody ages out while the test runs
CHUNK = 64  # calls in flight at once while setting up
SCRIPT_CALLS = ("info", "fcall", "evalsha")  # not commands of the script itself


async def _stats(client: aioredis.Redis) -> dict[str, int]:
    raw = await client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in raw.items()}


async def _measure(
    store: Any,
    client: aioredis.Redis,
    candidates: tuple[Candidate, ...],
    policies: list[TenantPolicy],
    decisions: int,
    tag: str,
) -> tuple[float, set[str]]:
    """The mean commands per admission of `decisions` asks from the tenants in turn (an
    admitted one is released again, uncounted), and their outcomes."""
    counts = []
    outcomes: set[str] = set()
    for i in range(decisions + 1):
        policy = policies[(7 * i) % len(policies)]
        ask = AdmissionAsk(f"{tag}{i}", candidates, 1.0, policy)
        before = await _stats(client)
        result = await store.try_admit(ask)
        after = await _stats(client)
        delta: dict[str, Any] = {k: v - before.get(k, 0) for k, v in after.items()}
        scripts = delta.get("fcall", 0) + delta.get("evalsha", 0)
        assert scripts == 1, delta  # this call's script, and nothing else
        if i > 0:  # the first one may count the records written in the set-up (once)
            counts.append(sum(v for k, v in delta.items() if k not in SCRIPT_CALLS))
        outcomes.add(result.code if not isinstance(result, Lease) else "admitted")
        if isinstance(result, Lease):
            await store.release(result)
    return statistics.mean(counts), outcomes


async def commands_per_admission(
    tenants: int, waiting: int, decisions: int = 20
) -> tuple[float, float]:
    """Mean commands per admission with `waiting` entries in the line, then with none."""
    prefix = new_prefix()
    store = redis_store(prefix, lease_ttl_s=600.0, active_window_s=WINDOW_S)
    client = aioredis.from_url(redis_url())
    try:
        blocks = 8 * (2 * tenants + waiting) // ENGINES + 200
        specs = [
            EngineSpec(f"e{i}", f"http://e{i}", frozenset({"m"}), blocks + 1, 16, 10**6, 10**6)
            for i in range(ENGINES)
        ]
        need = Footprint(8, 1, 128)
        candidates = tuple(Candidate(EngineView(s, EngineLoad()), need) for s in specs)
        names = frozenset(s.name for s in specs)
        policies = [TenantPolicy(name=f"t{i}") for i in range(tenants)]
        store.headroom, headroom = 0.0, store.headroom  # set-up: no records yet

        async def setup(i: int) -> None:
            lease = await store.try_admit(AdmissionAsk(f"a{i}", candidates, 1.0, policies[i]))
            assert isinstance(lease, Lease), lease
            if i % 2:
                await store.release(lease)

        for start in range(0, tenants, CHUNK):
            await asyncio.gather(*(setup(i) for i in range(start, min(tenants, start + CHUNK))))

        async def wait(i: int) -> None:
            entry = QueueEntry(f"w{i}", policies[i % tenants], names, 8, 10**5)
            assert await store.enqueue(entry, 10**6) == "queued"

        for start in range(0, waiting, CHUNK):
            await asyncio.gather(*(wait(i) for i in range(start, min(waiting, start + CHUNK))))
        seconds, micros = await client.time()
        now = repr(seconds + micros / 1e6)
        pipe = client.pipeline(transaction=False)
        for i, policy in enumerate(policies):
            held = "0" if i % 2 else "8"
            record = {"w": "1", "s": now, "u": held, "us": now, "n": repr(WINDOW_S)}
            pipe.hset(f"{{{prefix}}}:act", policy.name, json.dumps(record))
        await pipe.execute()
        store.headroom = headroom

        with_line = await _measure(store, client, candidates, policies, decisions, "d")
        assert with_line[1] & {"admitted", "queued_ahead", "no_capacity"}

        async def leave(i: int) -> None:
            await store.dequeue(f"w{i}")

        for start in range(0, waiting, CHUNK):
            await asyncio.gather(*(leave(i) for i in range(start, min(waiting, start + CHUNK))))
        no_line = await _measure(store, client, candidates, policies, decisions, "n")
        assert "admitted" in no_line[1], no_line  # the headroom rule's whole path
        return with_line[0], no_line[0]
    finally:
        await store.close()
        await client.aclose()
        await drop_keys(prefix)


async def test_redis_commands_per_admission_do_not_grow_with_tenants_or_waiting() -> None:
    small = await commands_per_admission(10, 10)
    large = await commands_per_admission(10_000, 1_000)
    # Behind the line (refused queued_ahead), and admitted with the line empty.
    assert large[0] <= 2 * small[0], (small, large)
    assert large[1] <= 2 * small[1], (small, large)


async def commands_per_grouped_admission(engines: int, decisions: int = 30) -> tuple[float, int]:
    """Mean Redis commands per admission of a grouped ask over `engines` engines of one
    group (each lease kept, so the engines' free blocks part and the order moves), with the
    headroom rule on and another tenant active; and the arguments the script is sent."""
    prefix = new_prefix()
    store = redis_store(prefix, lease_ttl_s=600.0, active_window_s=WINDOW_S, order_min_engines=1)
    client = aioredis.from_url(redis_url())
    try:
        specs = [
            EngineSpec(f"e{i:03}", "", frozenset({"m"}), 1000 + (i % 3), 16, 256, 10**6)
            for i in range(engines)
        ]
        await store.set_views([EngineView(s, EngineLoad()) for s in specs])
        await store.set_group("m", frozenset(s.name for s in specs), 1.0)
        other = await store.try_admit(
            AdmissionAsk("other", tenant=TenantPolicy("b"), group="m", need=Footprint(8, 1, 64))
        )
        assert isinstance(other, Lease)
        counts = []
        sent = 0
        for i in range(decisions):
            ask = AdmissionAsk(
                f"d{i}", tenant=TenantPolicy("a"), group="m", need=Footprint(8, 1, 64)
            )
            before = await _stats(client)
            result = await store.try_admit(ask)
            after = await _stats(client)
            delta: dict[str, Any] = {k: v - before.get(k, 0) for k, v in after.items()}
            assert delta.get("fcall", 0) + delta.get("evalsha", 0) == 1, delta
            assert isinstance(result, Lease), result
            counts.append(sum(v for k, v in delta.items() if k not in SCRIPT_CALLS))
            sent = len(store._admit_args(ask))
        return statistics.mean(counts), sent
    finally:
        await store.close()
        await client.aclose()
        await drop_keys(prefix)


async def test_redis_commands_per_grouped_admission_do_not_grow_with_engines() -> None:
    """Engines kept ordered in Redis (admit.lua `ordered`, common.lua `reorder`): a grouped
    ask reads the top of its group's order, not every engine, and the lease moves one
    engine. 100 engines within 2x of 4, in commands and in the arguments sent (the
    candidates form sent 11 per engine, and admit.lua read and scored each)."""
    small, small_args = await commands_per_grouped_admission(4)
    large, large_args = await commands_per_grouped_admission(100)
    assert large <= 2 * small, (small, large)
    assert large_args == small_args, (small_args, large_args)
