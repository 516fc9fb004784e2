"""In-process state: the embedded default when no Redis is configured."""

from __future__ import annotations

import random
from dataclasses import replace

from gateway.core.routing import Candidate, Chooser, Router
from gateway.core.types import EngineLoad
from gateway.state.base import AdmissionAsk, Lease


class InMemoryStore:
    """Leases in a dict; atomic because nothing in `try_admit` awaits."""

    def __init__(self, router: Router, chooser: Chooser | None = None) -> None:
        self._router = router
        self._chooser: Chooser = chooser or random.Random()
        self._leases: dict[str, Lease] = {}
        self._loads: dict[str, EngineLoad] = {}

    async def try_admit(self, ask: AdmissionAsk) -> Lease | None:
        if ask.lease_id in self._leases:
            raise KeyError(f"lease {ask.lease_id} already exists")
        views = [
            Candidate(
                view=replace(c.view, load=self._loads.get(c.view.spec.name, EngineLoad())),
                need=c.need,
            )
            for c in ask.candidates
        ]
        chosen = self._router.pick(views, ask.kv_ceiling, self._chooser)
        if chosen is None:
            return None
        lease = Lease(
            id=ask.lease_id,
            engine=chosen.view.spec.name,
            blocks=chosen.need.blocks,
            seqs=chosen.need.seqs,
            tenant=ask.tenant,
        )
        self._leases[lease.id] = lease
        self._add(lease.engine, lease.blocks, lease.seqs)
        return lease

    async def release(self, lease: Lease) -> bool:
        held = self._leases.pop(lease.id, None)
        if held is None:
            return False
        self._add(held.engine, -held.blocks, -held.seqs)
        return True

    async def loads(self) -> dict[str, EngineLoad]:
        return dict(self._loads)

    async def close(self) -> None:
        return None

    def _add(self, engine: str, blocks: int, seqs: int) -> None:
        load = self._loads.get(engine, EngineLoad())
        new = EngineLoad(load.reserved_blocks + blocks, load.reserved_seqs + seqs)
        if new == EngineLoad():
            self._loads.pop(engine, None)
        else:
            self._loads[engine] = new
