"""Two stores driven in lockstep by the same random operations, for the tests that show one
deciding exactly as the other (`test_engine_groups`, `test_redis_engine_groups`): the
operations besides admission, each applied to both, their answers compared."""

from __future__ import annotations

from typing import Any

from gateway.core.types import TenantPolicy
from gateway.state.base import Lease, QueueEntry

MAX_LENGTH = 8  # the line's length in these tests


async def step(
    a: Any,
    b: Any,
    op: tuple[Any, ...],
    *,
    leases: dict[str, Lease],
    next_id: int,
    policies: tuple[TenantPolicy, ...],
    engines: frozenset[str],
    clock: Any,
) -> int:
    """Apply `op` — ("enqueue", tenant, blocks, wait), ("dequeue", n), ("release", n),
    ("extend", n, blocks) or ("tick", seconds) — to both stores `a` and `b`, asserting that
    they answer alike; `leases` (by id) follows releases and extensions. Returns the next id
    (an enqueue uses one: entries are "r<id % 31>", as queued admissions' leases)."""
    if op[0] == "enqueue":
        _, t, blocks, wait = op
        entry = QueueEntry(f"r{next_id % 31}", policies[t], engines, blocks, wait)
        assert await a.enqueue(entry, MAX_LENGTH) == await b.enqueue(entry, MAX_LENGTH)
        return next_id + 1
    if op[0] == "dequeue":
        await a.dequeue(f"r{op[1]}")
        await b.dequeue(f"r{op[1]}")
    elif op[0] in ("release", "extend") and leases:
        lease = sorted(leases.values(), key=lambda x: x.id)[op[1] % len(leases)]
        if op[0] == "release":
            assert await a.release(lease, 0) == await b.release(lease, 0)
            del leases[lease.id]
        else:
            grown = await a.extend(lease, op[2])
            assert grown == await b.extend(lease, op[2])
            leases[lease.id] = grown
    elif op[0] == "tick":
        clock.now += op[1]
    return next_id
