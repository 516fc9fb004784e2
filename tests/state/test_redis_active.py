"""The Redis store's active-tenant aggregates (common.lua, issue 14): the weights' sum is
exact (rounded once, as gateway/state/active.py's), and the aggregates always count exactly
the records, also after they are lost (rebuilt from the records)."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.core.routing import Candidate
from gateway.core.types import EngineLoad, EngineSpec, EngineView, Footprint, TenantPolicy
from gateway.state.active import _scaled, _unscaled
from gateway.state.base import AdmissionAsk, Lease, QueueEntry
from gateway.state.redis import KEY_NAMES, _script_source
from tests.redis_server import redis_url
from tests.state.conftest import drop_keys, new_prefix, redis_store

pytestmark = pytest.mark.redis

SUM = """
local sums, first = {}, nil
for i = 3, #ARGV do
  local w = tonumber(ARGV[i])
  if first == nil then first = w end
  for k, v in pairs(limbs(w)) do sums[k] = (sums[k] or 0) + v end
end
return {fmt(weight_sum(sums, nil)), fmt(weight_sum(sums, limbs(first)))}
"""


async def test_the_weights_sum_is_exact_whatever_the_weights() -> None:
    prefix = new_prefix()
    keys = [f"{{{prefix}}}:{name}" for name in KEY_NAMES]
    script = _script_source("inspect").split("\n-- Read what the store holds")[0] + SUM
    rng = random.Random(7)
    client = aioredis.from_url(redis_url())
    try:
        cases = [
            [0.1] * 10,
            [0.1, 0.2, 0.3],
            [1.0, 2.0**-60, 2.0**-60],  # below the last bit of 1: ties and sticky bits
            [1.0, 2.0**-53, 2.0**-53 * 1.5],
            [1e300, 1e-300, 3.0],
            [5e-324, 5e-324, 1.0],
        ]
        cases += [[rng.uniform(0.01, 10) for _ in range(rng.randint(1, 40))] for _ in range(40)]
        cases += [[rng.lognormvariate(0, 20) for _ in range(rng.randint(1, 40))] for _ in range(40)]
        # Sums whose rounding needs the limbs below the top four (ties, sticky bits), and
        # weights spread over the whole exponent range (the four-limb way and the bit by bit
        # way for subnormal sums).
        ties = [1.0, 0.5, 3.0, 0.1, 2.0**-52, 2.0**-53, 1 + 2.0**-52, 2.0**-80]
        cases += [[rng.choice(ties) for _ in range(rng.randint(2, 30))] for _ in range(60)]
        spread = [
            [
                rng.randint(1, 2**53) * 2.0 ** rng.randint(-1100, 60)
                for _ in range(rng.randint(1, 8))
            ]
            for _ in range(60)
        ]
        cases += [[w for w in ws if w > 0] or [1.0] for ws in spread]
        for weights in cases:
            got = await client.eval(script, len(keys), *keys, "130", "c", *map(repr, weights))
            total = sum(_scaled(w) for w in weights)
            assert float(got[0]) == _unscaled(total), weights
            assert float(got[1]) == _unscaled(total - _scaled(weights[0])), weights
            naive = 0.0
            for w in weights:
                naive += w
            assert float(got[0]) == pytest.approx(naive, rel=1e-12)
    finally:
        await client.aclose()


async def _aggregates(client: aioredis.Redis, prefix: str) -> dict[str, Any]:
    key = f"{{{prefix}}}:"
    records = {k.decode(): json.loads(v) for k, v in (await client.hgetall(key + "act")).items()}
    sums = {k.decode(): int(v) for k, v in (await client.hgetall(key + "acts")).items()}
    ratios = {k.decode(): s for k, s in await client.zrange(key + "actr", 0, -1, withscores=True)}
    aging = {k.decode(): s for k, s in await client.zrange(key + "acta", 0, -1, withscores=True)}
    ten = {k.decode(): int(v) for k, v in (await client.hgetall(key + "ten")).items()}
    queued: dict[str, int] = {}
    for m in await client.zrange(key + "qtf", 0, -1):
        name = m.decode().split("\0")[0]
        queued[name] = queued.get(name, 0) + 1
    return {
        "records": records,
        "sums": sums,
        "ratios": ratios,
        "aging": aging,
        "ten": ten,
        "queued": queued,
    }


def _check(got: dict[str, Any]) -> None:
    records, sums = got["records"], got["sums"]
    held = {t: got["ten"].get(f"k:{t}", 0) for t in records}
    assert sums.get("n", 0) == len(records)
    assert sums.get("h", 0) == sum(held.values())
    assert {t: int(r["h"]) for t, r in records.items()} == held
    limbs = {k: v for k, v in sums.items() if k.startswith("w:")}
    scaled = sum(v << (24 * int(k[2:])) for k, v in limbs.items())
    assert scaled == sum(_scaled(float(r["w"])) for r in records.values())
    assert got["ratios"] == {t: h / float(records[t]["w"]) for t, h in held.items() if h > 0}
    unpinned = {t for t in records if held[t] == 0 and got["queued"].get(t, 0) == 0}
    assert got["aging"] == {t: float(records[t]["s"]) for t in unpinned}


async def test_the_aggregates_count_the_records_and_are_rebuilt_when_lost() -> None:
    prefix = new_prefix()
    store = redis_store(prefix, active_window_s=600.0)
    client = aioredis.from_url(redis_url())
    rng = random.Random(3)
    try:
        specs = [
            EngineSpec(f"e{i}", f"http://e{i}", frozenset({"m"}), 400, 16, 10**6, 10**6)
            for i in range(2)
        ]
        candidates = tuple(
            Candidate(EngineView(s, EngineLoad()), Footprint(8, 1, 128)) for s in specs
        )
        names = frozenset(s.name for s in specs)
        policies = [
            TenantPolicy(name=f"t{i}", weight=w) for i, w in enumerate((1.0, 0.1, 2.5, 0.3, 7.0))
        ]
        leases: list[Lease] = []
        entries: list[tuple[str, TenantPolicy]] = []
        outcomes = set()
        for i in range(300):
            policy = rng.choice(policies)
            op = rng.random()
            if op < 0.45:
                got = await store.try_admit(AdmissionAsk(f"a{i}", candidates, 1.0, policy))
                outcomes.add(got.code if not isinstance(got, Lease) else "admitted")
                if isinstance(got, Lease):
                    leases.append(got)
            elif op < 0.7 and leases:
                await store.release(leases.pop(rng.randrange(len(leases))))
            elif op < 0.8:
                entry = QueueEntry(f"w{i}", policy, names, 8, 600)
                if await store.enqueue(entry, 50) == "queued":
                    entries.append((entry.id, policy))
            elif op < 0.9 and entries:  # the head of the line (the first that may go)
                for entry_id, owner in list(entries):
                    ask = AdmissionAsk(entry_id, candidates, 1.0, owner, queued=True)
                    got = await store.try_admit(ask)
                    if isinstance(got, Lease):
                        outcomes.add("served")
                        leases.append(got)
                        entries.remove((entry_id, owner))
                        break
            elif entries:
                await store.dequeue(entries.pop(rng.randrange(len(entries)))[0])
            if i % 50 == 0:
                _check(await _aggregates(client, prefix))
        assert {"admitted", "served"} <= outcomes, outcomes
        before = await _aggregates(client, prefix)
        _check(before)
        assert len(before["records"]) == len(policies)
        assert before["ratios"] and before["aging"] is not None
        # Lost (or written by an older version): the next decision counts the records again.
        await client.delete(*(f"{{{prefix}}}:{k}" for k in ("acts", "actr", "acta")))
        got = await store.try_admit(AdmissionAsk("again", candidates, 1.0, policies[0]))
        if isinstance(got, Lease):
            leases.append(got)
        _check(await _aggregates(client, prefix))
        # A replica still on the scripts before issue 14 rewrites a record (no h, a new
        # weight, the aggregates untouched); the next change of that tenant notices.
        act = f"{{{prefix}}}:act"
        record = json.loads(await client.hget(act, policies[1].name))
        del record["h"]
        record["w"] = "5"
        await client.hset(act, policies[1].name, json.dumps(record))
        entry = QueueEntry("old", policies[1], names, 8, 600)
        assert await store.enqueue(entry, 10**6) == "queued"
        entries.append((entry.id, policies[1]))
        got = await store.try_admit(AdmissionAsk("later", candidates, 1.0, policies[2]))
        if isinstance(got, Lease):
            leases.append(got)
        _check(await _aggregates(client, prefix))
        for lease in leases:
            await store.release(lease)
        for entry_id, _ in entries:
            await store.dequeue(entry_id)
        after = await _aggregates(client, prefix)
        _check(after)
        assert after["ratios"] == {} and set(after["aging"]) == set(after["records"])
    finally:
        await store.close()
        await client.aclose()
        await drop_keys(prefix)


async def test_tenants_that_aged_out_are_forgotten_from_the_aggregates() -> None:
    prefix = new_prefix()
    store = redis_store(prefix, active_window_s=60.0)  # the set-up: nobody ages out
    short = redis_store(prefix, replica="replica-b", active_window_s=0.05)
    client = aioredis.from_url(redis_url())
    try:
        spec = EngineSpec("e", "http://e", frozenset({"m"}), 1000, 16, 10**6, 10**6)
        candidates = (Candidate(EngineView(spec, EngineLoad()), Footprint(8, 1, 128)),)
        held = []
        for i in range(250):  # more than one batch of acta (100)
            got = await store.try_admit(
                AdmissionAsk(f"a{i}", candidates, 1.0, TenantPolicy(name=f"t{i}"))
            )
            assert isinstance(got, Lease), got
            if i < 3:
                held.append(got)  # these stay active: they hold blocks
            else:
                await store.release(got)
        before = await _aggregates(client, prefix)
        _check(before)
        assert len(before["records"]) == 250 and len(before["aging"]) == 247
        await asyncio.sleep(0.3)
        got = await short.try_admit(AdmissionAsk("b", candidates, 1.0, TenantPolicy(name="new")))
        assert isinstance(got, Lease), got
        after = await _aggregates(client, prefix)
        _check(after)
        assert set(after["records"]) == {"t0", "t1", "t2", "new"}  # 247 forgotten at once
        assert after["aging"] == {}
        await short.release(got)
        for lease in held:
            await store.release(lease)
    finally:
        await store.close()
        await short.close()
        await client.aclose()
        await drop_keys(prefix)
