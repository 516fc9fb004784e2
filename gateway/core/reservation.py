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
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

from gateway.core.kvmath import ceil_div

__all__ = [
    "AdaptivePolicy",
    "AdaptiveQuantile",
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

    def predicted(self, quantile: float | None = None) -> int | None:
        """The quantile (nearest rank) of the window — the policy's, or `quantile` — None
        until `min_samples` were seen."""
        n = len(self._sorted)
        if n < self.policy.min_samples:
            return None
        q = self.policy.quantile if quantile is None else quantile
        rank = math.ceil(round(q * n, 9))  # round: 0.9 × 10 is 9, not 9.0…2
        return self._sorted[max(1, rank) - 1]


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


@dataclass(frozen=True, slots=True)
class AdaptivePolicy:
    """The `adaptive` reservation: a predicted quantile steered by the engines' preemptions.

    `target_per_1000`: preemptions per 1,000 completed requests the controller aims at (at
    most); the quantile moves between `min_quantile` and 1 (the longest output in the window)
    by `step` at a time."""

    target_per_1000: float = 1.0
    min_quantile: float = 0.5
    step: float = 0.02

    def __post_init__(self) -> None:
        if not self.target_per_1000 > 0:
            raise ValueError(f"target_per_1000 must be > 0, not {self.target_per_1000}")
        if not 0 < self.min_quantile <= 1:
            raise ValueError(f"min_quantile must be in (0, 1], not {self.min_quantile}")
        if not 0 < self.step <= 1:
            raise ValueError(f"step must be in (0, 1], not {self.step}")


class AdaptiveQuantile:
    """Feedback from the engine: the quantile of recent outputs to reserve for, kept where
    the engines preempt at most `target_per_1000` times per 1,000 completed requests.

    An allowance grows by `target / 1000` per completed request and shrinks by one per
    preemption (`vllm:num_preemptions_total` rising). Tighten fast: each whole preemption
    the allowance falls below zero moves the quantile up a step at once (more is reserved,
    fewer requests run at once, the engine stops running out of blocks). Relax slowly: a
    whole preemption's allowance to spare moves it down one step, and spends it. The debt
    is never forgiven: preemptions come in bursts (when the quantile falls under a tail of
    long outputs, every long answer admitted since outgrows its lease), and a burst of N
    over budget keeps the quantile from relaxing until N / target × 1,000 quiet requests
    have paid it back. So over a long run the engines preempt at most at the target rate,
    plus what one burst adds, whatever the workload's tail. Pure: the caller feeds the
    counts it observed."""

    def __init__(self, policy: AdaptivePolicy, start: float) -> None:
        self.policy = policy
        self.quantile = min(1.0, max(policy.min_quantile, start))
        self._allowance = 0.0

    @property
    def allowance(self) -> float:
        """Preemptions still allowed (negative: owed) by the target so far."""
        return self._allowance

    def observe(self, *, completed: int = 0, preemptions: int = 0) -> None:
        """`completed` requests finished and the engines preempted `preemptions` times since
        the last call."""
        if completed < 0 or preemptions < 0:
            raise ValueError("counts cannot be negative")
        owed_before = _whole_debt(self._allowance)
        # Rounded: a thousand additions of 0.001 make 1, not 0.999…9.
        self._allowance = round(
            self._allowance + completed * self.policy.target_per_1000 / 1000 - preemptions, 9
        )
        steps_up = _whole_debt(self._allowance) - owed_before
        if steps_up > 0:
            self.quantile = min(1.0, self.quantile + steps_up * self.policy.step)
        elif self._allowance >= 1.0:
            self.quantile = max(self.policy.min_quantile, self.quantile - self.policy.step)
            self._allowance -= 1.0


def _whole_debt(allowance: float) -> int:
    """Whole preemptions over budget."""
    return max(0, math.floor(-allowance))
