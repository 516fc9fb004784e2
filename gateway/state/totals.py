"""What a store holds in total: for tests ("everything returns to zero") and for metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StoreTotals:
    leases: int = 0
    queued: int = 0
    reserved_blocks: int = 0
    reserved_seqs: int = 0
    tenant_in_flight: dict[str, int] = field(default_factory=dict)  # non-zero entries only
    tenant_blocks: dict[str, int] = field(default_factory=dict)  # non-zero entries only

    @property
    def empty(self) -> bool:
        return self == StoreTotals()
