"""The engine driven by a virtual clock: whole load scenarios in milliseconds, no HTTP.

``simulate`` runs steps back to back, as vLLM's engine loop does while it has work, and jumps
the clock to the next arrival when it is idle. Use it for policy studies (how many requests of
a given shape fit, when preemption starts, what the queue does to time to first token).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gateway.sim.engine import Engine, EngineLimits, Finished, RequestSpec, StepTiming


@dataclass(frozen=True)
class Arrival:
    at: float
    spec: RequestSpec


@dataclass(frozen=True)
class TracePoint:
    """The engine's /metrics view while a step runs (after its scheduling decisions)."""

    t: float
    running: int
    waiting: int
    kv_cache_usage: float
    num_preemptions: int


@dataclass(frozen=True)
class SimulationReport:
    finished: tuple[Finished, ...]
    trace: tuple[TracePoint, ...]
    steps: int
    ends_at: float

    @property
    def max_running(self) -> int:
        return max((p.running for p in self.trace), default=0)

    @property
    def max_waiting(self) -> int:
        return max((p.waiting for p in self.trace), default=0)

    @property
    def num_preemptions(self) -> int:
        return self.trace[-1].num_preemptions if self.trace else 0

    def ttft(self) -> dict[str, float]:
        """Time to first token of every request that produced one."""
        return {
            f.request_id: f.first_token_at - f.arrival
            for f in self.finished
            if f.first_token_at is not None
        }


def simulate(
    arrivals: Iterable[Arrival],
    limits: EngineLimits,
    timing: StepTiming | None = None,
    *,
    max_steps: int = 10_000_000,
) -> SimulationReport:
    """Run every arrival to completion on a fresh engine; the clock starts at 0."""
    engine = Engine(limits, timing)
    pending = sorted(arrivals, key=lambda a: a.at)
    pending.reverse()  # pop() from the end = earliest first
    finished: list[Finished] = []
    trace: list[TracePoint] = []
    now = 0.0
    steps = 0
    while pending or engine.has_work():
        while pending and pending[-1].at <= now:
            arrival = pending.pop()
            engine.add(arrival.spec, arrival.at)
        if not engine.has_work():
            now = pending[-1].at
            continue
        if steps >= max_steps:
            raise RuntimeError(f"simulation did not finish within {max_steps} steps")
        batch = engine.begin_step(now)
        if not batch.scheduled:
            raise RuntimeError("engine has work but scheduled nothing")  # a model bug
        snap = engine.snapshot()
        trace.append(
            TracePoint(now, snap.running, snap.waiting, snap.kv_cache_usage, snap.num_preemptions)
        )
        finished.extend(engine.end_step(batch).finished)
        now = batch.ends_at
        steps += 1
    return SimulationReport(finished=tuple(finished), trace=tuple(trace), steps=steps, ends_at=now)
