"""Token-length distributions of a synthetic workload: fixed, uniform, normal, lognormal.

Spec strings (`--input-len`, `--output-len`, workload files):

    128                 fixed
    fixed:128           fixed
    uniform:64,256      whole numbers from 64 to 256, each equally likely
    normal:128,32       mean 128, standard deviation 32, rounded
    lognormal:128,0.5   median 128, sigma 0.5 of the log, rounded

Contract: `sample` never returns less than 1, and a `max_len` clamps from above; randomness
comes from the `random.Random` passed in.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

KINDS = ("fixed", "uniform", "normal", "lognormal")


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
        if self.kind == "lognormal":
            return self.a * math.exp(self.b**2 / 2)
        return self.a

    def sample(self, rng: random.Random, max_len: int | None = None) -> int:
        if self.kind == "fixed":
            value = round(self.a)
        elif self.kind == "uniform":
            value = rng.randint(round(self.a), round(self.b))
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
    if kind in ("normal", "lognormal") and (numbers[0] < 1 or numbers[1] < 0):
        raise ValueError(f"length {spec!r}: {kind} needs a centre ≥ 1 and a spread ≥ 0")
    return Lengths(kind, *numbers)
