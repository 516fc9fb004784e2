"""Admission at scale (issue 14): the in-process store's work per decision does not grow
with tenants or waiting requests.

The work is counted, not timed: Python lines executed during `try_admit` (`sys.settrace`,
every frame: the store, the core, sortedcontainers), so the count means the same
for any implementation. At 10,000 tenants (each admitted an 8-block lease, every second one
released again: all active) and 1,000 waiting it must stay within 2x of the count at 10
tenants and 10 waiting. (The store before issue 14 visited every tenant, and counted each
one's entries by scanning the line: 632 lines at 10 and 10, 10,285,204 here.) Grouped asks
(`AdmissionAsk.group`: the engines kept ordered by the store) must also not grow with the
engines: 100 against 4.
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


async def lines_per_decision(
    tenants: int, waiting: int, decisions: int = 30, engines: int = ENGINES, grouped: bool = False
) -> float:
    """Lines per `try_admit`; `grouped`: grouped asks (`AdmissionAsk.group`) over the
    engines, else one candidate per engine."""
    clock = Clock()
    store = InMemoryStore(Router(), random.Random(0), clock=clock)
    blocks = 8 * (2 * tenants + waiting) // engines + 200
    specs = [
        EngineSpec(f"e{i}", f"http://e{i}", frozenset({"m"}), blocks + 1 + i % 3, 16, 10**6, 10**6)
        for i in range(engines)
    ]
    need = Footprint(8, 1, 128)
    candidates = tuple(Candidate(EngineView(s, EngineLoad()), need) for s in specs)
    await store.set_views([c.view for c in candidates])
    await store.set_group("m", frozenset(s.name for s in specs), 1.0)

    def ask_of(lease_id: str, policy: TenantPolicy) -> AdmissionAsk:
        if grouped:
            return AdmissionAsk(lease_id, tenant=policy, group="m", need=need)
        return AdmissionAsk(lease_id, candidates, 1.0, policy)

    policies = [TenantPolicy(name=f"t{i}") for i in range(tenants)]
    for i, policy in enumerate(policies):
        lease = await store.try_admit(ask_of(f"a{i}", policy))
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
        ask = ask_of(f"d{i}", policies[(7 * i) % tenants])
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


async def test_work_per_grouped_decision_does_not_grow_with_engines() -> None:
    """Decisions that reach routing (nobody waiting): a grouped ask over 100 engines costs
    what one over 4 does; the same ask as 100 candidates costs far more (the form every
    decision took before)."""
    small = await lines_per_decision(10, 0, engines=4, grouped=True)
    large = await lines_per_decision(10, 0, engines=100, grouped=True)
    assert large <= 2 * small, (small, large)
    scored = await lines_per_decision(10, 0, engines=100)
    assert scored > 5 * large, (scored, large)


async def test_work_per_grouped_decision_at_the_issues_scale() -> None:
    """100 engines x 10,000 tenants x 1,000 waiting against 4 x 10 x 10, grouped asks. The
    line's entries want every engine, so these decisions mostly end `queued_ahead`: what
    this shows is that nothing before routing visits the engines (the candidates form
    credits, filters and names each one there); routing itself is the test above."""
    small = await lines_per_decision(10, 10, engines=4, grouped=True)
    large = await lines_per_decision(10_000, 1_000, engines=100, grouped=True)
    assert large <= 2 * small, (small, large)
    scored = await lines_per_decision(10, 10, engines=100)  # as candidates: it grows
    assert scored > 2 * small, (scored, small)
