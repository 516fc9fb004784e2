"""The engine's step loop on the real clock: one asyncio task owns the pure engine.

Handlers ``submit`` sequences with a sink queue and read ``Generated`` / ``Ended`` events from
it; ``abort`` is idempotent and frees the sequence's blocks at once. Between ``begin_step`` and
``end_step`` the loop sleeps for the step's modelled duration, as a GPU would be busy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.sim.engine import Engine, EngineSnapshot, FinishReason, RequestSpec
from gateway.sim.metrics import EngineMetrics


@dataclass(frozen=True)
class Generated:
    request_id: str
    index: int  # of the output token


@dataclass(frozen=True)
class Ended:
    request_id: str
    reason: FinishReason
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


Event = Generated | Ended


class EngineLoop:
    """Owns ``engine``; ``run()`` is the step loop (start it once, cancel it to stop)."""

    def __init__(
        self,
        engine: Engine,
        metrics: EngineMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.engine = engine
        self._metrics = metrics
        self._clock = clock
        self._sleep = sleep
        self._sinks: dict[str, asyncio.Queue[Event]] = {}
        self._wake = asyncio.Event()
        self.failed: BaseException | None = None

    def submit(self, spec: RequestSpec, sink: asyncio.Queue[Event]) -> None:
        self.engine.add(spec, self._clock())
        self._sinks[spec.request_id] = sink
        self._wake.set()

    def abort(self, request_id: str) -> None:
        if self.engine.abort(request_id, self._clock()) is not None:
            self._forget(request_id)

    def snapshot(self) -> EngineSnapshot:
        return self.engine.snapshot()

    async def run(self) -> None:
        try:
            while True:
                if not self.engine.has_work():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                batch = self.engine.begin_step(self._clock())
                if not batch.scheduled:  # cannot happen with validated limits; never spin
                    self.engine.end_step(batch)
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._sleep(batch.seconds)
                # Stamped with the clock, not the modelled end: the histograms then include
                # the sleep's overshoot, as vLLM's include its own overheads.
                outcome = self.engine.end_step(batch, at=self._clock())
                self._metrics.observe_step(outcome)
                for token in outcome.tokens:
                    self._deliver(Generated(token.request_id, token.index))
                for finished in outcome.finished:
                    self._deliver(
                        Ended(finished.request_id, finished.reason, finished.num_cached_tokens)
                    )
                    self._forget(finished.request_id)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the engine is dead: /health answers 503
            self.failed = exc
            raise

    def _deliver(self, event: Event) -> None:
        sink = self._sinks.get(event.request_id)
        if sink is not None:
            sink.put_nowait(event)

    def _forget(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
