"""Served fair-share tags of tenants gone for good are forgotten (issue 14), on both stores:
the line's memory holds the tenants that still count, not every tenant ever served."""

from __future__ import annotations

import redis.asyncio as aioredis

from gateway.core.types import TenantPolicy
from gateway.state.base import Lease
from gateway.state.memory import InMemoryStore
from tests.redis_server import redis_url
from tests.state.test_conformance import spec, tenant_ask


async def _tags(store, prefix: str) -> int:
    if isinstance(store, InMemoryStore):
        return store._line.served_tags()
    client = aioredis.from_url(redis_url())
    try:
        fields = await client.hkeys(f"{{{prefix}}}:fair")
    finally:
        await client.aclose()
    return sum(1 for f in fields if f.startswith(b"f:"))


async def test_one_shot_tenants_tags_are_forgotten(store_with, prefix):
    store = store_with(burst_blocks=16)
    a = spec("a", blocks=101, seqs=100)
    steady = TenantPolicy("steady")
    for i in range(300):
        # A steady tenant moves the virtual time on; a new tenant comes once and goes.
        for policy in (steady, TenantPolicy(f"once-{i}")):
            lease = await store.try_admit(tenant_ask(a, policy, blocks=8))
            assert isinstance(lease, Lease)
            await store.release(lease)
    # Kept: the steady tenant's and those within B / weight = 2 requests of V.
    assert await _tags(store, prefix) <= 6
