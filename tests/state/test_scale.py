"""Admission at scale (issue 14): the in-process store's work per decision does not grow
with tenants or waiting requests.

The work is counted, not timed: Python lines executed during `try_admit` (`sys.settrace`,
every frame: the store, the core, sortedcontainers), so the count means the same
for any implementation. At 10,000 tenants (each admitted an 8-block lease, every second one
released again: all active) and 1,000 waiting it must stay within 2x of the count at 10
tenants and 10 waiting. (The store before issue 14 visited every tenant, and counted each
one's entries by scanning the line: 632 lines at 10 and 10, 10,285,204 here.)
"""

from __future__ import annotations

import random
import statistics
import sys
from types import FrameType
from typing import Any

from gateway.core.routing import Candidate, Router
from gateway.core.types import EngineLoad, EngineSpec, EngineView, Footprint, TenantPolicy
from gateway.state.base import AdmissionAsk, Lease, QueueEntry
from gateway.state.memory import InMemoryStore

ENGINES = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def lines_per_decision(tenants: int, waiting: int, decisions: int = 30) -> float:
    clock = Clock()
    store = InMemoryStore(Router(), random.Random(0), clock=clock)
    blocks = 8 * (2 * tenants + waiting) // ENGINES + 200
    specs = [
        EngineSpec(f"e{i}", f"http://e{i}", frozenset({"m"}), blocks + 1, 16, 10**6, 10**6)
        for i in range(ENGINES)
    ]
    candidates = tuple(Candidate(EngineView(s, EngineLoad()), Footprint(8, 1, 128)) for s in specs)
    policies = [TenantPolicy(name=f"t{i}") for i in range(tenants)]
    for i, policy in enumerate(policies):
        lease = await store.try_admit(AdmissionAsk(f"a{i}", candidates, 1.0, policy))
        assert isinstance(lease, Lease)
        if i % 2:
            await store.release(lease)
    store.headroom, headroom = 0.0, store.headroom  # a quick set-up: all are active already
    names = frozenset(s.name for s in specs)
    for i in range(waiting):
        entry = QueueEntry(f"w{i}", policies[i % tenants], names, 8, 10**6)
        assert await store.enqueue(entry, 10**6) == "queued"
    store.headroom = headroom

    counted = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal counted
        if event == "line":
            counted += 1
        return trace

    counts = []
    outcomes = set()
    for i in range(decisions):
        clock.now += 0.001
        ask = AdmissionAsk(f"d{i}", candidates, 1.0, policies[(7 * i) % tenants])
        counted = 0
        sys.settrace(trace)
        try:
            result = await store.try_admit(ask)
        finally:
            sys.settrace(None)
        counts.append(counted)
        outcomes.add(result.code if not isinstance(result, Lease) else "admitted")
        if isinstance(result, Lease):
            await store.release(result)
    assert outcomes & {"admitted", "queued_ahead", "no_capacity"}
    return statistics.mean(counts)


async def test_work_per_decision_does_not_grow_with_tenants_or_waiting() -> None:
    small = await lines_per_decision(10, 10)
    large = await lines_per_decision(10_000, 1_000)
    assert large <= 2 * small, (small, large)
