"""How much output to reserve KV for: the worst case, or a learned prediction.

`worst_case` reserves every sequence's whole output budget (`max_tokens`, or what the
context leaves): the engine can never run out of blocks, so it never preempts, but a client
that asks for 2,000 tokens and stops after 100 holds 20× the KV it uses.

`predicted` reserves `min(budget, q)` output tokens, where `q` is the `quantile` of the
output lengths (tokens per sequence) of the model's last `window` completed requests. Until
`min_samples` requests have completed it reserves the worst case. A sequence that outgrows
its prediction takes blocks nobody reserved; the engine's own report of used blocks
(`free = capacity − max(reserved, reported)`) then holds admission back, but a burst of such
sequences can make the engine preempt: the mode trades that risk for concurrency.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

__all__ = ["OutputLengths", "PredictionPolicy"]


@dataclass(frozen=True, slots=True)
class PredictionPolicy:
    quantile: float = 0.9
    window: int = 1000
    min_samples: int = 50

    def __post_init__(self) -> None:
        if not 0 < self.quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], not {self.quantile}")
        if self.window < 1 or not 1 <= self.min_samples <= self.window:
            raise ValueError(
                f"need 1 <= min_samples <= window, not {self.min_samples} and {self.window}"
            )


class OutputLengths:
    """The last `window` observed output lengths of one model, and their quantile."""

    def __init__(self, policy: PredictionPolicy) -> None:
        self.policy = policy
        self._recent: deque[int] = deque()
        self._sorted: list[int] = []

    def observe(self, tokens: int) -> None:
        """One completed request's output tokens per sequence."""
        if tokens < 0:
            raise ValueError(f"an output length cannot be negative: {tokens}")
        if len(self._recent) == self.policy.window:
            oldest = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._recent.append(tokens)
        bisect.insort(self._sorted, tokens)

    def __len__(self) -> int:
        return len(self._recent)

    def predicted(self) -> int | None:
        """The quantile (nearest rank) of the window; None until `min_samples` were seen."""
        n = len(self._sorted)
        if n < self.policy.min_samples:
            return None
        rank = math.ceil(round(self.policy.quantile * n, 9))  # round: 0.9 × 10 is 9, not 9.0…2
        return self._sorted[max(1, rank) - 1]
