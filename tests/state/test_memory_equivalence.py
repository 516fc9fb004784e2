"""The in-process store after issue 14 (maintained aggregates, indexed line) decides exactly
as the one before it, which visited every tenant and scanned the line per decision.

Random sequences of admissions, enqueues, dequeues, releases, extensions and clock steps go
to both (`memory_reference` is the old store, on the old line); every answer, the loads and
the totals must agree. Weights are multiples of 1/4: their sums are exact in binary, so the
old store's float sum of the active weights (in the order seen) and the new exact one are
the same number (for weights like 0.1 they may differ in the last bit; see
gateway/state/active.py). Capacities and asks are small so that the sum of unused shares
often lands exactly on the free blocks, where the new store falls back to the sum term by
term.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.routing import Candidate, Router
from gateway.core.types import EngineLoad, EngineSpec, EngineView, Footprint, TenantPolicy
from gateway.state.base import AdmissionAsk, Lease
from gateway.state.memory import InMemoryStore
from tests.state import lockstep
from tests.state.memory_reference import InMemoryStore as Reference

SPECS = (
    EngineSpec("e1", "http://e1", frozenset({"m"}), 31, 16, 6, 4096),
    EngineSpec("e2", "http://e2", frozenset({"m"}), 19, 16, 4, 4096),
)
POLICIES = (
    TenantPolicy("a", weight=1.0),
    TenantPolicy("b", weight=2.0),
    TenantPolicy("c", weight=0.25, max_queued=3),
    TenantPolicy("d", weight=1.5, priority=1),
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


admit = st.tuples(
    st.just("admit"),
    st.integers(0, 3),
    st.sampled_from((0, 1, 2, 4, 6, 8, 12, 16)),
    st.frozensets(st.sampled_from((0, 1)), min_size=1),
    st.booleans(),
)
op = st.one_of(
    admit,
    admit,
    admit,
    st.tuples(st.just("enqueue"), st.integers(0, 3), st.integers(1, 12), st.integers(1, 20)),
    st.tuples(st.just("dequeue"), st.integers(0, 30)),
    st.tuples(st.just("release"), st.integers(0, 30)),
    st.tuples(st.just("extend"), st.integers(0, 30), st.integers(1, 5)),
    st.tuples(st.just("tick"), st.sampled_from((0.5, 3.0, 11.0))),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(op, max_size=80), st.sampled_from((0.0, 0.2, 0.5)), st.sampled_from((0.0, 10.0)))
async def test_the_store_decides_as_before_issue_14(
    ops: list[tuple], headroom: float, window: float
) -> None:
    clock = Clock()
    kwargs = dict(clock=clock, headroom=headroom, active_window_s=window, burst_blocks=16)
    new = InMemoryStore(Router(), random.Random(7), **kwargs)  # type: ignore[arg-type]
    old = Reference(Router(), random.Random(7), **kwargs)  # type: ignore[arg-type]
    leases: dict[str, Lease] = {}
    ids = 0
    for o in ops:
        if o[0] == "admit":
            _, t, blocks, engines, queued = o
            cands = tuple(
                Candidate(EngineView(SPECS[i], EngineLoad()), Footprint(blocks, 1, blocks * 16))
                for i in sorted(engines)
            )
            lease_id = f"r{ids % 31}" if queued else f"n{ids}"
            ids += 1
            if lease_id in leases:
                continue
            ask = AdmissionAsk(lease_id, cands, 1.0, POLICIES[t], queued=queued)
            got, want = await new.try_admit(ask), await old.try_admit(ask)
            assert got == want
            if isinstance(got, Lease):
                leases[got.id] = got
        else:
            ids = await lockstep.step(
                new,
                old,
                o,
                leases=leases,
                next_id=ids,
                policies=POLICIES,
                engines=frozenset({"e1", "e2"}),
                clock=clock,
            )
        assert await new.loads() == await old.loads()
        assert await new.totals() == await old.totals()
        assert await new.queue_length() == await old.queue_length()
    for lease in leases.values():
        await new.release(lease)
        await old.release(lease)
