"""Token-length distributions of a synthetic workload: fixed, uniform, log-uniform, normal,
lognormal.

Spec strings (`--input-len`, `--output-len`, workload files):

    128                 fixed
    fixed:128           fixed
    uniform:64,256      whole numbers from 64 to 256, each equally likely
    loguniform:128,2048 whole numbers from 128 to 2048, log-uniform: as many from 128 to 256
                        as from 1024 to 2048 (k with probability ∝ ln((k + 1) / k))
    normal:128,32       mean 128, standard deviation 32, rounded
    lognormal:128,0.5   median 128, sigma 0.5 of the log, rounded

Contract: `sample` never returns less than 1, and a `max_len` clamps from above; randomness
comes from the `random.Random` passed in.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

KINDS = ("fixed", "uniform", "loguniform", "normal", "lognormal")


@dataclass(frozen=True, slots=True)
class Lengths:
    kind: str
    a: float
    b: float = 0.0

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"{self.a:g}"
        return f"{self.kind}:{self.a:g},{self.b:g}"

    @property
    def mean(self) -> float:
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        if self.kind == "loguniform":
            return _loguniform_mean(round(self.a), round(self.b))
        if self.kind == "lognormal":
            return self.a * math.exp(self.b**2 / 2)
        return self.a

    def sample(self, rng: random.Random, max_len: int | None = None) -> int:
        if self.kind == "fixed":
            value = round(self.a)
        elif self.kind == "uniform":
            value = rng.randint(round(self.a), round(self.b))
        elif self.kind == "loguniform":
            low, high = round(self.a), round(self.b)
            # The continuous log-uniform on [low, high + 1), rounded down: every whole number
            # in low..high, `high` included, and none outside (uniform() may return its end).
            drawn = math.exp(rng.uniform(math.log(low), math.log(high + 1)))
            value = min(high, math.floor(drawn))
        elif self.kind == "normal":
            value = round(rng.gauss(self.a, self.b))
        else:
            value = round(rng.lognormvariate(math.log(self.a), self.b))
        value = max(1, value)
        return value if max_len is None else min(value, max_len)


def parse_lengths(spec: str) -> Lengths:
    """A distribution from its spec; ValueError with a one-line reason otherwise."""
    kind, sep, rest = spec.strip().partition(":")
    if not sep:
        kind, rest = "fixed", kind
    if kind not in KINDS:
        raise ValueError(f"length {spec!r}: unknown distribution {kind!r} (one of {KINDS})")
    try:
        numbers = [float(x) for x in rest.split(",")]
    except ValueError:
        raise ValueError(f"length {spec!r}: expected numbers after {kind}:") from None
    need = 1 if kind == "fixed" else 2
    if len(numbers) != need or not all(math.isfinite(x) for x in numbers):
        raise ValueError(f"length {spec!r}: {kind} takes {need} number(s)")
    if kind == "fixed" and numbers[0] < 1:
        raise ValueError(f"length {spec!r}: must be at least 1")
    if kind == "uniform" and not 1 <= numbers[0] <= numbers[1]:
        raise ValueError(f"length {spec!r}: uniform needs 1 ≤ low ≤ high")
    if kind == "loguniform" and not (
        1 <= numbers[0] <= numbers[1] and all(x == round(x) for x in numbers)
    ):
        raise ValueError(f"length {spec!r}: loguniform needs whole numbers 1 ≤ low ≤ high")
    if kind in ("normal", "lognormal") and (numbers[0] < 1 or numbers[1] < 0):
        raise ValueError(f"length {spec!r}: {kind} needs a centre ≥ 1 and a spread ≥ 0")
    return Lengths(kind, *numbers)


def _loguniform_mean(low: int, high: int) -> float:
    """Mean of `loguniform:low,high` (k in low..high with probability ln((k + 1) / k) / Z),
    in closed form: Σ k ln((k + 1) / k) telescopes to (high + 1) ln(high + 1) − low ln(low)
    − ln((high + 1)! / low!)."""
    weighted = (
        (high + 1) * math.log(high + 1)
        - low * math.log(low)
        - (math.lgamma(high + 2) - math.lgamma(low + 1))
    )
    return weighted / math.log((high + 1) / low)
