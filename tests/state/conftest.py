"""One conformance suite for every state store: each test runs against each backend."""

import random

import pytest

from gateway.core.routing import Router
from gateway.state.memory import InMemoryStore

BACKENDS = ["memory"]


@pytest.fixture(params=BACKENDS)
async def store(request):
    if request.param == "memory":
        s = InMemoryStore(Router(), random.Random(0))
    yield s
    loads = await s.loads()
    await s.close()
    # Every test must leave nothing reserved behind.
    assert all(v.reserved_blocks == 0 and v.reserved_seqs == 0 for v in loads.values()), loads
