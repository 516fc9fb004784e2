"""What the gateway believes, as one JSON-ready snapshot: `/admin/status` renders it.

Engines (with where each of their figures came from, what they last reported, and what the
gateway holds on them) and the waiting line. Read from the pool and the state store; a lost
Redis raises `StateUnavailable` (503 under `fail_closed`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gateway.engines.pool import EnginePool, EngineState
from gateway.state.base import StateStore


async def snapshot(
    store: StateStore,
    pool: EnginePool,
    kv_ceiling: float,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """`{"engines": [...], "queue": {"length": n}}`; the schema is documented in the README."""
    loads = await store.loads()
    engines = []
    for state in pool:
        load = loads.get(state.spec.name)
        engines.append(
            {
                **_engine(state, kv_ceiling, clock()),
                "reserved_blocks": load.reserved_blocks if load else 0,
                "reserved_seqs": load.reserved_seqs if load else 0,
            }
        )
    return {"engines": engines, "queue": {"length": await store.queue_length()}}


def _engine(state: EngineState, kv_ceiling: float, now: float) -> dict[str, Any]:
    spec = state.spec
    return {
        "name": spec.name,
        "url": spec.url,
        "models": sorted(spec.models),
        "healthy": state.healthy,
        "last_error": state.last_error,
        "reported": {
            "used_blocks": state.used_blocks,
            "running": state.running,
            "waiting": state.waiting,
            "kv_cache_usage": state.kv_cache_usage,
            "num_preemptions": state.preemptions,
            "age_s": None if state.last_scrape is None else round(now - state.last_scrape, 3),
            "missing": list(state.missing),
        },
        "foreign": {"seqs": state.foreign.seqs, "blocks": state.foreign.blocks},
        "num_gpu_blocks": spec.num_gpu_blocks,
        "block_size": spec.block_size,
        "max_num_seqs": spec.max_num_seqs,
        "max_model_len": spec.max_model_len,
        "capacity_blocks": spec.capacity_blocks(kv_ceiling),
        "sources": state.sources,
    }
