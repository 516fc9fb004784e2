"""The engines the gateway fronts: their specs, health, and what they last reported.

Start-up discovery fills the specs; the monitor (`engines/monitor.py`) keeps health and the
engines' own figures current; routing reads views from here. One place, one truth.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gateway.core.ledger import Foreign
from gateway.core.types import EngineLoad, EngineSpec, EngineView

log = logging.getLogger(__name__)


@dataclass
class EngineState:
    spec: EngineSpec
    sources: dict[str, str] = field(default_factory=dict)
    healthy: bool = True
    # What the engine reported at its last scrape (None until scraped).
    used_blocks: int | None = None
    running: int | None = None
    waiting: int | None = None
    kv_cache_usage: float | None = None
    preemptions: int | None = None
    last_scrape: float | None = None
    # The load that is not the gateway's own, estimated at the last scrape (core/ledger.py),
    # and the figures the engine's page lacked then (empty: a complete page).
    foreign: Foreign = field(default_factory=Foreign)
    missing: tuple[str, ...] = ()
    # Health bookkeeping.
    failures: int = 0
    suspect: int = 0  # probes in a row that timed out while the engine was still routed to
    last_error: str | None = None
    next_probe_at: float = 0.0
    # 200 answers started and their chunks, as the data plane received them from the engine
    # (counters, no clock): a probe that times out while `progress` moves met a busy engine,
    # not a hung one, as long as the engine also starts new answers (`starts`; the monitor
    # notes when it last saw one in `new_work_at`).
    progress: int = 0
    starts: int = 0
    starts_seen: int = 0
    new_work_at: float = 0.0
    # The engine refused a request at its own front door (vLLM's --max-num-queued-reqs or
    # --max-num-queued-tokens: 503): "full now". Not routed to until then, or until one of
    # the gateway's requests on it ends.
    full_until: float = 0.0
    # The engine was seen running more sequences than its configured `max_num_seqs`: that
    # figure is a cap below the engine's own, so no sequence is staged beyond it
    # (`admission.staged_seqs`: staged requests would run, not wait).
    runs_beyond_max: bool = False
    # Its cache may have been emptied since: counted up when its process start time changes
    # or it is readmitted after an ejection (what the gateway expects it to cache is then
    # forgotten: gateway/core/prefix.py PrefixIndex).
    epoch: int = 0
    started: float | None = None  # process_start_time_seconds at the last scrape
    # The pool's set of engines whose view may have changed (`EnginePool.changed_views`):
    # setting any field a view reads adds this engine to it, wherever it is set from.
    dirty: set[str] | None = field(default=None, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _VIEW_FIELDS:
            dirty = self.__dict__.get("dirty")
            if dirty is not None:
                dirty.add(self.spec.name)


_VIEW_FIELDS = frozenset({"spec", "healthy", "foreign", "full_until", "runs_beyond_max"})
"""The fields of `EngineState` that `EnginePool.view` reads."""


class EnginePool:
    def __init__(
        self,
        specs: list[EngineSpec],
        sources: dict[str, dict[str, str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        staged_seqs: int = 0,
    ) -> None:
        self.clock = clock
        self.staged_seqs = staged_seqs
        self._engines: dict[str, EngineState] = {
            s.name: EngineState(spec=s, sources=dict((sources or {}).get(s.name, {})))
            for s in specs
        }
        self._fresh_wanted = asyncio.Event()
        self._dirty: set[str] = set(self._engines)  # every view is new to a store
        self._full: dict[str, float] = {}  # engines refused as full: until when
        for e in self._engines.values():
            e.dirty = self._dirty

    def changed_views(self) -> list[EngineView]:
        """The views (with no load) of the engines whose view may have changed since the
        last call: a field it reads was set (a scrape, an ejection, a refusal, a request
        ending) or the time an engine was held as full is up. What a store that keeps the
        engines' views is given (`StateStore.set_views`), so that a decision need not read
        every engine."""
        if self._full:
            now = self.clock()
            for name, until in list(self._full.items()):
                if now >= until:
                    del self._full[name]
                    self._dirty.add(name)
        if not self._dirty:
            return []
        names = sorted(self._dirty)
        self._dirty.clear()
        return [self.view(name, EngineLoad()) for name in names if name in self._engines]

    def want_fresh(self, names: Iterable[str]) -> bool:
        """A request waits for room on `names`: if one of them carries load the gateway
        estimated as foreign at its last scrape (which may have ended since), ask the monitor
        for new figures before its next round; True when asked (now or already)."""
        if self._fresh_wanted.is_set():
            return True  # asked already: every waiter calls this at each re-check
        for name in names:
            e = self._engines.get(name)
            if e is not None and e.healthy and (e.foreign.seqs or e.foreign.blocks):
                self._fresh_wanted.set()
                return True
        return False

    async def fresh_wanted(self, within_s: float) -> bool:
        """Wait up to `within_s` for a `want_fresh` request; True if one came (the monitor)."""
        if within_s > 0 and not self._fresh_wanted.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._fresh_wanted.wait(), within_s)
        return self._fresh_wanted.is_set()

    def probing(self) -> None:
        """A round of scrapes begins: it answers the requests for fresh figures made so far."""
        self._fresh_wanted.clear()

    def __iter__(self) -> Iterator[EngineState]:
        return iter(self._engines.values())

    def get(self, name: str) -> EngineState | None:
        return self._engines.get(name)

    def serving(self, model: str) -> list[EngineState]:
        return [e for e in self._engines.values() if model in e.spec.models]

    def models(self) -> dict[str, int]:
        """Each served model id and the largest max_model_len among its engines."""
        out: dict[str, int] = {}
        for e in self._engines.values():
            for m in e.spec.models:
                out[m] = max(out.get(m, 0), e.spec.max_model_len)
        return out

    def view(self, name: str, load: EngineLoad) -> EngineView:
        e = self._engines[name]
        return EngineView(
            spec=e.spec,
            load=load,
            healthy=e.healthy and self.clock() >= e.full_until,
            foreign_blocks=e.foreign.blocks,
            foreign_seqs=e.foreign.seqs,
            staged_seqs=0 if e.runs_beyond_max else self.staged_seqs,
        )

    def answer_started(self, name: str) -> None:
        """The data plane received a 200 answer's status from the engine (see `progress`)."""
        e = self._engines.get(name)
        if e is not None:
            e.starts += 1
            e.progress += 1

    def answer_progressed(self, name: str) -> None:
        """The data plane received a chunk of an answer from the engine."""
        e = self._engines.get(name)
        if e is not None:
            e.progress += 1

    def refused(self, name: str, hold_s: float) -> None:
        """The engine answered "full" at its front door: not routed to for `hold_s`, or until
        one of the gateway's requests on it ends (`ended`)."""
        e = self._engines.get(name)
        if e is not None:
            e.full_until = self.clock() + hold_s
            self._full[name] = e.full_until

    def ended(self, name: str) -> None:
        """One of the gateway's requests on the engine ended: its front door has room again."""
        e = self._engines.get(name)
        if e is not None and e.full_until:
            e.full_until = 0.0
            self._full.pop(name, None)

    def mark_unhealthy(self, name: str, reason: str, *, retry_at: float) -> None:
        e = self._engines[name]
        if e.healthy:
            log.warning("engine %s ejected from routing: %s", name, reason)
        e.healthy = False
        e.failures += 1
        e.suspect = 0
        e.last_error = reason
        e.next_probe_at = retry_at
        # Its figures are no longer known.
        e.used_blocks = e.running = e.waiting = None
        e.foreign = Foreign()

    def mark_healthy(self, name: str) -> None:
        e = self._engines[name]
        if not e.healthy:
            log.info("engine %s readmitted after %d failed probe(s)", name, e.failures)
            e.epoch += 1  # it may have restarted meanwhile
        e.healthy = True
        e.failures = 0
        e.last_error = None
        e.next_probe_at = 0.0

    def started(self, name: str, started: float | None) -> None:
        """The engine's process start time as its page gave it; a new one is a restart."""
        e = self._engines[name]
        if started is None:
            return
        if e.started is not None and started != e.started:
            log.info("engine %s restarted (its process start time changed)", name)
            e.epoch += 1
        e.started = started

    def update_spec(self, name: str, source: str, **changes: Any) -> None:
        """The engine now reports other numbers (e.g. restarted with another KV size)."""
        e = self._engines[name]
        changed = {k: v for k, v in changes.items() if getattr(e.spec, k) != v}
        if "dp_size" in changed and "max_num_seqs" not in changes:
            # `max_num_seqs` is the engine's total: vLLM's per-rank flag × its ranks.
            per_rank = e.spec.max_num_seqs // e.spec.dp_size
            changed["max_num_seqs"] = per_rank * changed["dp_size"]
        if not changed:
            return
        # One line per change of the engine's figures, however many of them changed.
        log.info(
            "engine %s: %s (%s)",
            name,
            ", ".join(f"{k} changed {getattr(e.spec, k)} → {v}" for k, v in changed.items()),
            source,
        )
        for key in changed:
            e.sources[key] = source
        e.spec = dataclasses.replace(e.spec, **changed)
