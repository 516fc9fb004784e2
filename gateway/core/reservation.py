"""How much output to reserve KV for: the worst case, or a learned prediction.

`worst_case` reserves every sequence's whole output budget (`max_tokens`, or what the
context leaves): the engine can never run out of blocks, so it never preempts, but a client
that asks for 2,000 tokens and stops after 100 holds 20× the KV it uses.

`predicted` reserves `min(budget, q)` output tokens, where `q` is the `quantile` of the
output lengths (tokens per sequence) of the last `window` completed requests (the service
keeps one window per model and one per model and tenant). Until `min_samples` requests have
completed it reserves the worst case. A sequence that outgrows
its prediction takes blocks nobody reserved; the engine's own report of used blocks
(`free = capacity − max(reserved, reported)`) then holds admission back, but a burst of such
sequences can make the engine preempt: the mode trades that risk for concurrency. For a
streamed answer the gateway sees the tokens go by and extends the lease as soon as the
sequence outgrows it (`blocks_short`), so admission counts the growth at once.

`adaptive` reserves a quantile plus a margin for the tail, steered by the engines' own
preemption counter to a target rate (`AdaptiveReservation`).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

from gateway.core.kvmath import ceil_div

__all__ = [
    "QUANTILE_PER_MARGIN",
    "AdaptivePolicy",
    "AdaptiveReservation",
    "OutputLengths",
    "PredictionPolicy",
    "blocks_short",
]

# A stream that outgrew its lease is topped up by what it lacks plus this many blocks per
# sequence, so that a long answer extends its lease once per this many blocks, not per token.
LOOKAHEAD_BLOCKS = 2


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
        self._excess: dict[float, float] = {}  # by quantile, until the next observation

    def observe(self, tokens: int) -> None:
        """One completed request's output tokens per sequence."""
        if tokens < 0:
            raise ValueError(f"an output length cannot be negative: {tokens}")
        if len(self._recent) == self.policy.window:
            oldest = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._recent.append(tokens)
        bisect.insort(self._sorted, tokens)
        self._excess.clear()

    def __len__(self) -> int:
        return len(self._recent)

    def predicted(self, quantile: float | None = None) -> int | None:
        """The quantile (nearest rank) of the window — the policy's, or `quantile` — None
        until `min_samples` were seen."""
        n = len(self._sorted)
        if n < self.policy.min_samples:
            return None
        q = self.policy.quantile if quantile is None else quantile
        rank = math.ceil(round(q * n, 9))  # round: 0.9 × 10 is 9, not 9.0…2
        return self._sorted[max(1, rank) - 1]

    def excess(self, quantile: float | None = None) -> float:
        """The window's mean excess over its quantile: the mean of `max(0, length − q)`
        over every sample (0 until `min_samples` were seen)."""
        q = self.policy.quantile if quantile is None else quantile
        cached = self._excess.get(q)
        if cached is not None:
            return cached
        at = self.predicted(q)
        mean = 0.0
        if at is not None:
            above = self._sorted[bisect.bisect_right(self._sorted, at) :]
            mean = (sum(above) - at * len(above)) / len(self._sorted)
        self._excess[q] = mean
        return mean


def blocks_short(
    *,
    held_blocks: int,
    seqs: int,
    prompt_tokens: int,
    generated: int,
    budget: int,
    block_size: int,
) -> int:
    """Blocks a streaming request's lease lacks, to add now; 0 while it has enough.

    Each of its `seqs` sequences holds `prompt_tokens + generated` tokens (`generated` per
    sequence) and needs a slot for the next one; the lease holds `held_blocks // seqs` per
    sequence. When that falls short, the answer is what is missing plus `LOOKAHEAD_BLOCKS`
    per sequence, never past the worst case (`prompt_tokens + budget`).
    """
    have = held_blocks // seqs
    need = ceil_div(prompt_tokens + generated + 1, block_size)
    if need <= have:
        return 0
    most = ceil_div(prompt_tokens + budget, block_size)
    return max(0, min(need + LOOKAHEAD_BLOCKS, most) - have) * seqs


# Beyond the margin's range the position moves the quantile, this much per unit of position.
QUANTILE_PER_MARGIN = 0.1


@dataclass(frozen=True, slots=True)
class AdaptivePolicy:
    """The `adaptive` reservation: a predicted quantile plus a margin for the tail, the
    margin steered by the engines' preemptions.

    `target_per_1000`: preemptions per 1,000 completed requests the controller aims at (at
    most). It steers one position: from 0 to `max_margin` the margin (how many times the
    mean excess over the quantile is added, see `AdaptiveReservation`), below 0 a lower
    quantile (down to `min_quantile`), beyond `max_margin` a higher one (up to 1). A
    preemption moves it `step` up; a completed request `step × target / 1000` down. It
    starts at `start_margin` and steers only after `warmup_requests` completed requests,
    so that a cold start's preemptions are not owed."""

    target_per_1000: float = 1.0
    start_margin: float = 6.0
    max_margin: float = 10.0
    step: float = 0.1
    min_quantile: float = 0.5
    warmup_requests: int = 1000

    def __post_init__(self) -> None:
        if not self.target_per_1000 > 0:
            raise ValueError(f"target_per_1000 must be > 0, not {self.target_per_1000}")
        if not 0 <= self.start_margin <= self.max_margin:
            raise ValueError(
                f"need 0 <= start_margin <= max_margin, not {self.start_margin} and "
                f"{self.max_margin}"
            )
        if not 0 < self.min_quantile <= 1:
            raise ValueError(f"min_quantile must be in (0, 1], not {self.min_quantile}")
        if not self.step > 0:
            raise ValueError(f"step must be > 0, not {self.step}")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests cannot be negative: {self.warmup_requests}")


class AdaptiveReservation:
    """Feedback from the engine: how much output to reserve, kept where the engines preempt
    at most `target_per_1000` times per 1,000 completed requests.

    The reservation is the quantile `q` of recent outputs plus `margin ×` their mean excess
    over it (`OutputLengths.excess`: the mean of `max(0, length − q)`). A quantile alone
    cannot cross a long tail's cliff smoothly (with 10 % long answers every quantile above
    0.9 reserves a long answer for every request, every one below a short answer for the
    long ones too); the margin can: at 0 it reserves the quantile, at `1 / (1 − q)` (10 for
    0.9) about the tail's mean for everyone, and in between a share of the tail's growth —
    room that the many short answers leave unused, and that the few long ones grow into.

    An integral controller: the position rises `step` per preemption and falls `step ×
    target / 1000` per completed request, so it rests where preemptions come at the target
    rate; a burst is paid back in full before the margin shrinks below where it was. Pure:
    the caller feeds the counts it observed."""

    def __init__(self, policy: AdaptivePolicy, quantile: float) -> None:
        self.policy = policy
        self.base_quantile = quantile
        self.position = policy.start_margin
        self.completed = 0  # requests seen to complete, the warm-up's included
        self._lowest = min(0.0, (policy.min_quantile - quantile) / QUANTILE_PER_MARGIN)
        self._highest = policy.max_margin + max(0.0, (1.0 - quantile) / QUANTILE_PER_MARGIN)

    @property
    def quantile(self) -> float:
        """The quantile of recent outputs reserved for now."""
        if self.position < 0:
            below = self.base_quantile + self.position * QUANTILE_PER_MARGIN
            return max(self.policy.min_quantile, round(below, 9))
        beyond = self.position - self.policy.max_margin
        if beyond > 0:
            return min(1.0, round(self.base_quantile + beyond * QUANTILE_PER_MARGIN, 9))
        return self.base_quantile

    @property
    def margin(self) -> float:
        """How many mean excesses over the quantile are added to it now."""
        return min(self.policy.max_margin, max(0.0, self.position))

    def observe(self, *, completed: int = 0, preemptions: int = 0) -> None:
        """`completed` requests finished and the engines preempted `preemptions` times since
        the last call. Nothing moves until more than `warmup_requests` have completed."""
        if completed < 0 or preemptions < 0:
            raise ValueError("counts cannot be negative")
        self.completed += completed
        if self.policy.warmup_requests and self.completed <= self.policy.warmup_requests:
            return
        step = self.policy.step
        moved = step * preemptions - step * self.policy.target_per_1000 / 1000 * completed
        # Held within its range: time spent at an end is not owed (no wind-up).
        self.position = min(self._highest, max(self._lowest, self.position + moved))

    def reserve(self, lengths: OutputLengths) -> int | None:
        """Output tokens per sequence to reserve, from `lengths`; None until it has enough
        samples."""
        quantile = self.quantile
        predicted = lengths.predicted(quantile)
        if predicted is None:
            return None
        return predicted + math.ceil(round(self.margin * lengths.excess(quantile), 9))
