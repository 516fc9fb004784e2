"""The load on an engine that is not the gateway's own, from one scrape and the ledger.

The gateway knows its own requests (its leases: the ledger); a scrape tells it the engine's
totals. What the gateway must not forget is the rest — another client going to the engine
directly, another gateway, a restarted engine — so it estimates, at each scrape:

    foreign_seqs   = max(0, reported running + waiting − own live sequences)
    foreign_blocks = max(0, reported used blocks − own reserved blocks)   when foreign_seqs is 0
                   = max(0, reported used blocks − own prompt blocks)     otherwise

Blocks are held only by running and waiting requests (an unreferenced prefix-cache block
counts as free), so with no foreign sequence, blocks in use beyond the gateway's own
reservations can only be its own requests outgrowing them (a `predicted` reservation whose
answer is longer than predicted, seen only in the engine's totals when it is not streamed):
they are counted too, until the next scrape. Otherwise the gateway's own actual use
is estimated from below — its requests hold at least their prompts' blocks once running — so
the foreign estimate errs on the large side (the gateway admits less, never more), except by
the prompt blocks of its own requests the engine has not started yet. Own figures are taken
around the scrape and the smaller kept (`own_during`), for the same reason.

A figure missing from the engine's page (another vLLM version, another engine) gives no
estimate of its kind: 0, and the engine is flagged (`Reported.complete`).

Pure: no I/O; the monitor passes what it read.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core.types import EngineLoad


@dataclass(frozen=True, slots=True)
class Reported:
    """What an engine's `/metrics` said at one scrape; None: not on the page."""

    running: int | None = None
    waiting: int | None = None
    used_blocks: int | None = None

    @property
    def complete(self) -> bool:
        return None not in (self.running, self.waiting, self.used_blocks)


@dataclass(frozen=True, slots=True)
class Foreign:
    """What is on an engine that the gateway's leases do not account for: foreign
    sequences, and blocks in use beyond the ledger (foreign, or own requests outgrowing a
    predicted reservation)."""

    seqs: int = 0
    blocks: int = 0


def own_during(before: EngineLoad, after: EngineLoad) -> EngineLoad:
    """The gateway's own load over a scrape, from the ledger read just before and just after:
    the smaller of each figure (the foreign estimate then errs on the large side)."""
    return EngineLoad(
        reserved_blocks=min(before.reserved_blocks, after.reserved_blocks),
        reserved_seqs=min(before.reserved_seqs, after.reserved_seqs),
        prompt_blocks=min(before.prompt_blocks, after.prompt_blocks),
    )


def foreign_load(reported: Reported, own: EngineLoad) -> Foreign:
    """The foreign load at the scrape (see the module docstring)."""
    seqs: int | None = None
    if reported.running is not None and reported.waiting is not None:
        seqs = max(0, reported.running + reported.waiting - own.reserved_seqs)
    if reported.used_blocks is None:
        return Foreign(seqs=seqs or 0, blocks=0)
    own_use = own.reserved_blocks if seqs == 0 else own.prompt_blocks
    return Foreign(seqs=seqs or 0, blocks=max(0, reported.used_blocks - own_use))
