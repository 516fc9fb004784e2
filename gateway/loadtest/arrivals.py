"""When requests arrive: open-loop schedules as offsets (seconds from the run's start).

- `Rate(rate, burstiness)`: intervals from a gamma distribution of mean `1/rate` and shape
  `burstiness` — 1 is a Poisson process, < 1 burstier, > 1 more regular, `inf` a constant
  interval (vLLM's `--burstiness` means the same); `rate=inf` sends everything at once.
- `Ramp(start, end, over_s, burstiness)`: the rate moves linearly from `start` to `end`
  req/s over `over_s` seconds, then stays at `end` (arrivals drawn in the ramp's cumulative
  time, so Poisson stays Poisson).
- `Replay(times, scale)`: a trace's timestamps multiplied by `scale` (0.5 = twice as fast).

Contract: `offsets(rng)` yields non-decreasing offsets ≥ 0, without end unless the schedule
is a replay; randomness only from the `random.Random` passed in.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol


class Arrivals(Protocol):
    def offsets(self, rng: random.Random) -> Iterator[float]: ...

    def describe(self) -> str: ...


def _unit_steps(burstiness: float, rng: random.Random) -> Iterator[float]:
    """Increments of mean 1: exponential (burstiness 1), gamma, or exactly 1 (inf)."""
    while True:
        if math.isinf(burstiness):
            yield 1.0
        elif burstiness == 1.0:
            yield rng.expovariate(1.0)
        else:
            yield rng.gammavariate(burstiness, 1.0 / burstiness)


@dataclass(frozen=True, slots=True)
class Rate:
    rate: float
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError("--rate must be positive (inf sends everything at once)")
        if not self.burstiness > 0:
            raise ValueError("--burstiness must be positive (1 = Poisson, inf = constant)")

    def describe(self) -> str:
        if math.isinf(self.rate):
            return "all at once (rate inf)"
        shape = {1.0: "Poisson"}.get(self.burstiness, f"gamma, burstiness {self.burstiness:g}")
        if math.isinf(self.burstiness):
            shape = "constant interval"
        return f"{self.rate:g} req/s, {shape}"

    def offsets(self, rng: random.Random) -> Iterator[float]:
        if math.isinf(self.rate):
            while True:
                yield 0.0
        at = 0.0
        for step in _unit_steps(self.burstiness, rng):
            at += step / self.rate
            yield at


@dataclass(frozen=True, slots=True)
class Ramp:
    start: float
    end: float
    over_s: float
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if self.start < 0 or self.end <= 0 or not math.isfinite(self.start + self.end):
            raise ValueError("a ramp needs finite rates, start ≥ 0 and end > 0")
        if not self.over_s > 0:
            raise ValueError("a ramp needs a positive duration")
        if not self.burstiness > 0:
            raise ValueError("--burstiness must be positive")

    def describe(self) -> str:
        return f"ramp {self.start:g} → {self.end:g} req/s over {self.over_s:g} s"

    def at(self, cumulative: float) -> float:
        """The time at which the expected number of arrivals reaches `cumulative`."""
        r0, r1, d = self.start, self.end, self.over_s
        in_ramp = (r0 + r1) / 2 * d
        if cumulative >= in_ramp:
            return d + (cumulative - in_ramp) / r1
        a = (r1 - r0) / (2 * d)
        if abs(a) < 1e-12:
            return cumulative / r0
        return (-r0 + math.sqrt(max(0.0, r0 * r0 + 4 * a * cumulative))) / (2 * a)

    def offsets(self, rng: random.Random) -> Iterator[float]:
        cumulative = 0.0
        for step in _unit_steps(self.burstiness, rng):
            cumulative += step
            yield self.at(cumulative)


@dataclass(frozen=True, slots=True)
class Replay:
    times: tuple[float, ...]
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.scale > 0 or math.isinf(self.scale):
            raise ValueError("--time-scale must be a positive number")

    def describe(self) -> str:
        return f"trace replay, time scale {self.scale:g}"

    def offsets(self, rng: random.Random) -> Iterator[float]:
        first = min(self.times, default=0.0)
        for at in self.times:
            yield (at - first) * self.scale
