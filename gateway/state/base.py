"""The shared-state port: reservations (leases) on engines.

Two adapters implement it — `memory.InMemoryStore` (one process) and `redis.RedisStore`
(several gateway replicas) — and one conformance suite (`tests/state/`) runs against both.
`try_admit` is atomic: checking capacity, choosing the engine and writing the lease happen
as one step, so concurrent admissions never over-commit an engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gateway.core.routing import Candidate
from gateway.core.types import EngineLoad


@dataclass(frozen=True, slots=True)
class Lease:
    """A reservation of `blocks` and `seqs` on `engine`, held until released (or expired)."""

    id: str
    engine: str
    blocks: int
    seqs: int
    tenant: str = "default"


@dataclass(frozen=True, slots=True)
class AdmissionAsk:
    """Everything `try_admit` needs: one candidate per engine the request may use."""

    lease_id: str
    candidates: tuple[Candidate, ...]
    kv_ceiling: float
    tenant: str = "default"


class StateStore(Protocol):
    async def try_admit(self, ask: AdmissionAsk) -> Lease | None:
        """Reserve on the best candidate that fits right now, or return None."""
        ...

    async def release(self, lease: Lease) -> bool:
        """Give the lease back. Idempotent: True the first time, False after."""
        ...

    async def loads(self) -> dict[str, EngineLoad]:
        """Reserved blocks and sequences per engine; engines holding nothing may be absent."""
        ...

    async def close(self) -> None: ...
