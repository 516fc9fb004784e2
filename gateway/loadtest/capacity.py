"""The SLO capacity: the highest open-loop rate at which a target meets every SLO for a
given share of its requests, found by bisection between 0 and its throughput capacity.

Pure: `SloSearch` decides the next rate to probe and, once the probes are spent, the
capacity; the caller runs each probe and records the share of its requests that met every
SLO. The first probe is at `start` × the throughput capacity, each next one halfway between
the highest rate that passed and the lowest that failed, so `max_probes` probes narrow the
boundary to `upper / 2**max_probes` (start 0.5).

Contract: a probe always lies strictly between every rate that passed and every rate that
failed, so the probes the search chooses are consistent even when the measurements are
noisy — a noisy failure below the true boundary only moves the answer down. Rates recorded
out of that order (a caller probing on its own) are judged conservatively: the capacity is
the highest rate that passed below the lowest rate that failed. The search has no
randomness: the same outcomes give the same probes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class Probe:
    rate: float  # requests per second offered
    met: float  # share of the probe's requests that met every SLO
    passed: bool


@dataclass(frozen=True, slots=True)
class SloSearch:
    upper: float  # the throughput capacity: never probed above
    quantile: float = 0.99  # a probe passes when at least this share met every SLO
    max_probes: int = 6
    start: float = 0.5  # the first probe, as a fraction of `upper`
    done: tuple[Probe, ...] = ()

    def __post_init__(self) -> None:
        if not self.upper > 0:
            raise ValueError("the SLO capacity search needs a positive throughput capacity")
        if not 0 < self.quantile <= 1:
            raise ValueError(f"capacity quantile {self.quantile:g} must be in (0, 1]")
        if self.max_probes < 1:
            raise ValueError("the SLO capacity search needs at least one probe")
        if not 0 < self.start < 1:
            raise ValueError(f"capacity search start {self.start:g} must be in (0, 1)")

    @property
    def high(self) -> float:
        """The lowest rate that failed (the throughput capacity before any failed)."""
        return min((p.rate for p in self.done if not p.passed), default=self.upper)

    @property
    def low(self) -> float:
        """The highest rate that passed below `high` (0 before any passed)."""
        high = self.high
        return max((p.rate for p in self.done if p.passed and p.rate < high), default=0.0)

    @property
    def capacity(self) -> float | None:
        """The SLO capacity found so far: `low`, or None while no probe has passed."""
        low = self.low
        return low if low > 0 else None

    def next_rate(self) -> float | None:
        """The rate to probe next, or None when the probes are spent."""
        if len(self.done) >= self.max_probes:
            return None
        if not self.done:
            return self.start * self.upper
        return (self.low + self.high) / 2

    def record(self, rate: float, met: float) -> SloSearch:
        """The search with the probe at `rate` done, `met` of its requests meeting every SLO."""
        probe = Probe(rate, met, met >= self.quantile)
        return replace(self, done=(*self.done, probe))

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests_per_s": self.capacity,
            "quantile": self.quantile,
            "throughput_requests_per_s": self.upper,
            "bracket": [self.low, self.high],
            "probes": [
                {"rate": round(p.rate, 4), "met": round(p.met, 4), "passed": p.passed}
                for p in self.done
            ],
        }
