"""Watching the engines: `/health` and `/metrics` every `scrape_interval_s`.

A probe that fails (connection refused, `/health` not 200, a page that does not parse)
ejects the engine from routing at once. A slow answer ejects it only after
`timeouts_to_eject` in a row, and not while the engine is still sending the gateway's
requests their answers and stream chunks (`EngineState.progress` moved during the probe)
and has started a new answer within `busy_grace_s`: vLLM on a saturated host answers
`/health` and renders `/metrics` late while it generates, and ejecting it then would fail
every request queued for it. An ejected engine is probed again after 1, 2, 4 … scrape
intervals (at most `backoff_max_s`; its failed probes alone count, not requests that fail
while it is out) and readmitted on the first success, after a fresh discovery — so an engine
restarted with another KV size or context length is picked up without restarting the gateway.
A healthy engine's scrape refreshes what
it reports in use (blocks, running, waiting), from which, with the gateway's own ledger read
just before and after, the load that is not the gateway's own is estimated
(`gateway/core/ledger.py`), notices a change of its KV geometry, and is handed to the
latency book when there is one (`pages`: gateway/latency.py). A page that lacks some
of vLLM's gauges (another version, another engine) does not eject the engine: it is routed on
the ledger and its configured figures, flagged at `/admin/status` (`missing`).
Waiting requests look at the pool again at least every `scheduler.POLL_S`, so they see
these changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TypeVar

import httpx

from gateway.config import HealthConfig
from gateway.core.ledger import Reported, foreign_load, own_during
from gateway.core.types import EngineLoad
from gateway.engines.discovery import DiscoveryError, discover
from gateway.engines.metrics import MetricsPage, MetricsParseError, parse_page
from gateway.engines.pool import EnginePool, EngineState

log = logging.getLogger(__name__)
T = TypeVar("T")

RESCRAPE_GAP_S = 0.2
"""The least time between two scrapes of the engines when waiting requests ask for fresh
figures (`EnginePool.want_fresh`): load estimated as foreign stays in the estimate until the
next scrape (`health.scrape_interval_s`, 1 s by default) although it may have ended at once.
At most 5 extra scrapes a second, and only while foreign load keeps a request waiting."""


OwnLoads = Callable[[], Awaitable[Mapping[str, EngineLoad] | None]]
"""The gateway's own load per engine from its ledger, None when the store cannot say."""

PageReader = Callable[[str, MetricsPage], None]
"""Given each engine's page after a successful scrape (the latency book's `scraped`)."""


def backoff_s(failures: int, interval_s: float, max_s: float) -> float:
    """Delay before the next probe of an engine that failed `failures` times in a row."""
    return float(min(max_s, interval_s * 2 ** max(0, failures - 1)))


class EngineMonitor:
    def __init__(
        self,
        pool: EnginePool,
        client: httpx.AsyncClient,
        cfg: HealthConfig,
        clock: Callable[[], float] = time.monotonic,
        own_loads: OwnLoads | None = None,
        pages: PageReader | None = None,
    ) -> None:
        self.pool = pool
        self.client = client
        self.cfg = cfg
        self.clock = clock
        self.own_loads = own_loads
        self.pages = pages
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            started = self.clock()
            self.pool.probing()
            await self.probe_all()
            await self.pause(started)

    async def pause(self, started: float) -> None:
        """Until the next round: `scrape_interval_s` after `started`, or sooner when a
        waiting request asks for fresh figures (`EnginePool.want_fresh`), but not within
        `RESCRAPE_GAP_S` of `started` (nor sooner than the interval itself)."""
        interval = self.cfg.scrape_interval_s
        if await self.pool.fresh_wanted(interval - (self.clock() - started)):
            gap = min(RESCRAPE_GAP_S, interval)
            await asyncio.sleep(max(0.0, gap - (self.clock() - started)))

    async def probe_all(self) -> None:
        now = self.clock()
        due = [e for e in self.pool if e.healthy or now >= e.next_probe_at]
        await asyncio.gather(*(self.probe(e) for e in due))

    def eject(self, name: str, reason: str) -> None:
        """Take an engine out of routing now: a request could not reach it (the proxy).
        An engine already out stays as it is: requests sent there before its ejection
        that fail afterwards neither count as failed probes nor put off its next probe,
        so it is readmitted as soon as the back-off of its probes alone allows."""
        state = self.pool.get(name)
        if state is None:
            return
        if not state.healthy:
            log.debug("engine %s, already out of routing, failed a request: %s", name, reason)
            return
        self._failed(name, reason)

    def _failed(self, name: str, reason: str) -> None:
        """Out of routing (or kept out) after a failed probe or request: probed again after
        1, 2, 4 … scrape intervals, one more doubling per failure in a row."""
        state = self.pool.get(name)
        if state is None:
            return
        delay = backoff_s(state.failures + 1, self.cfg.scrape_interval_s, self.cfg.backoff_max_s)
        self.pool.mark_unhealthy(name, reason, retry_at=self.clock() + delay)

    async def probe(self, state: EngineState) -> None:
        name, url = state.spec.name, state.spec.url
        progress = state.progress
        _note_new_work(state, self.clock())
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                health = await self.client.get(url + "/health")
                if health.status_code != 200:
                    raise DiscoveryError(url, f"/health answered {health.status_code}")
                if not state.healthy:
                    await self._rediscover(state)
                before = await self._own(name)
                page = _page(await self.client.get(url + "/metrics"))
                after = await self._own(name)
        except TimeoutError:
            now = self.clock()
            _note_new_work(state, now)
            busy = state.progress != progress and now - state.new_work_at <= self.cfg.busy_grace_s
            if state.healthy and busy:
                # Its answers kept arriving meanwhile, new ones included: busy, not hung. The
                # last snapshot stays (admission still counts its own reservations on top).
                log.debug(
                    "engine %s: probe slower than %g s while serving", name, self.cfg.timeout_s
                )
                state.suspect = 0
                return
            # A slow answer may be a busy engine: eject only after several in a row.
            state.suspect += 1
            log.debug("engine %s: probe timed out (%d in a row)", name, state.suspect)
            if not state.healthy or state.suspect >= self.cfg.timeouts_to_eject:
                self._failed(name, f"no answer within {self.cfg.timeout_s:g} s ({state.suspect}×)")
            return
        except (httpx.HTTPError, DiscoveryError) as e:
            log.debug("engine %s: probe failed: %s: %s", name, type(e).__name__, e)
            self._failed(name, f"{type(e).__name__}: {e}")
            return
        was_healthy = state.healthy
        state.suspect = 0
        state.new_work_at = self.clock()  # answering probes again: the grace starts afresh
        if page is not None:
            self.pool.started(name, page.started)
        if page is not None and page.cache is not None:
            geometry: dict[str, object] = {
                "num_gpu_blocks": page.cache.num_gpu_blocks,
                "block_size": page.cache.block_size,
                "dp_size": page.cache.dp_size,
            }
            if page.cache.enable_prefix_caching is not None:
                # Restarted with another flag: credit follows from now on (the stores make
                # the leases credited there whole: StateStore.set_views).
                geometry["prefix_caching"] = page.cache.enable_prefix_caching
            configured = _configured(state)
            self.pool.update_spec(
                name,
                "discovered:/metrics",
                **{k: v for k, v in geometry.items() if k not in configured},
            )
        models = (
            []
            if page is None
            else [m for m in page.models.values() if m.model_name in state.spec.models]
        )
        reported = Reported(
            running=_total(m.num_requests_running for m in models),
            waiting=_total(m.num_requests_waiting for m in models),
            used_blocks=max(_known(m.used_blocks for m in models), default=None),
        )
        state.running, state.waiting = reported.running, reported.waiting
        if (
            reported.running is not None
            and reported.running > state.spec.max_num_seqs
            and not state.runs_beyond_max
        ):
            state.runs_beyond_max = True
            if self.pool.staged_seqs:
                log.warning(
                    "engine %s runs %d sequences, more than its configured max_num_seqs %d: "
                    "that is a cap below the engine's own, so no sequence is staged beyond it "
                    "(admission.staged_seqs)",
                    name,
                    reported.running,
                    state.spec.max_num_seqs,
                )
        state.used_blocks = reported.used_blocks
        state.kv_cache_usage = max(_known(m.kv_cache_usage for m in models), default=None)
        state.preemptions = _total(m.num_preemptions_total for m in models)
        if page is None:
            missing = ["/metrics"]
        elif not models:
            missing = ["vLLM's gauges for its models"]
        else:
            missing = sorted({g for m in models for g in m.missing})
        if tuple(missing) != state.missing:
            if missing:
                log.warning(
                    "engine %s: its /metrics lacks %s; routed on the gateway's own ledger "
                    "and its configured figures",
                    name,
                    ", ".join(missing),
                )
            else:
                log.info("engine %s: its /metrics is complete again", name)
            state.missing = tuple(missing)
        if before is not None and after is not None:
            state.foreign = foreign_load(reported, own_during(before, after))
        state.last_scrape = self.clock()
        if page is not None and self.pages is not None:
            self.pages(name, page)
        if not was_healthy:
            self.pool.mark_healthy(name)

    async def _own(self, name: str) -> EngineLoad | None:
        """The gateway's own load on the engine now; None when the ledger cannot be read."""
        if self.own_loads is None:
            return EngineLoad()
        loads = await self.own_loads()
        return None if loads is None else loads.get(name, EngineLoad())

    async def _rediscover(self, state: EngineState) -> None:
        found = await discover(self.client, state.spec.url)
        changes: dict[str, object] = {}
        if found.max_model_len is not None and "max_model_len" not in _configured(state):
            changes["max_model_len"] = found.max_model_len
        if found.model_ids and state.sources.get("models") != "config":
            changes["models"] = frozenset(found.model_ids)
        if changes:
            self.pool.update_spec(state.spec.name, "rediscovered", **changes)


def _page(response: httpx.Response) -> MetricsPage | None:
    """The engine's `/metrics` page; None when it has none this module can read (the engine
    stays routed: see the module docstring)."""
    if response.status_code != 200:
        return None
    try:
        return parse_page(response.text)
    except MetricsParseError:
        return None


def _known(values: Iterable[T | None]) -> list[T]:
    return [v for v in values if v is not None]


def _total(values: Iterable[int | None]) -> int | None:
    """The sum, or None when any value is missing (or there is none)."""
    got = list(values)
    if not got or any(v is None for v in got):
        return None
    return sum(v for v in got if v is not None)


def _note_new_work(state: EngineState, now: float) -> None:
    """Remember when the engine was last seen starting a new answer."""
    if state.starts != state.starts_seen:
        state.starts_seen = state.starts
        state.new_work_at = now


def _configured(state: EngineState) -> set[str]:
    return {k for k, v in state.sources.items() if v == "config"}
