"""The workload a plan is sized for: prompt and output lengths, as means and 95th percentiles.

Given as numbers, or read from a trace through `gateway.traces` (the loadtest's reader: the
planner's JSONL with `prompt_tokens` and `output_tokens` on each line, Mooncake JSONL, CSV).
A request's length is prompt + output: the tokens its KV holds when it finishes (and,
with the gateway's worst-case reservation, what it reserves when `max_tokens` is its output).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gateway.traces import TraceError, TraceRequest, parse_trace


class WorkloadError(ValueError):
    """The workload is unusable; the message says where."""


@dataclass(frozen=True, slots=True)
class Workload:
    """Token lengths of the expected requests. MUST hold: every figure ≥ 0, p95 ≥ mean is not
    required (a skewed trace may have either), `total_p95 ≥ 1`."""

    prompt_mean: float
    prompt_p95: int
    output_mean: float
    output_p95: int
    total_p95: int
    requests: int | None = None
    source: str = "flags"

    @property
    def mean_len(self) -> int:
        """Mean request length in tokens (prompt + output), rounded up."""
        return max(1, math.ceil(self.prompt_mean + self.output_mean))


def from_figures(
    prompt_mean: float,
    output_mean: float,
    prompt_p95: int | None = None,
    output_p95: int | None = None,
) -> Workload:
    """A workload from flags; a missing p95 defaults to its mean (rounded up)."""
    if prompt_mean < 0 or output_mean < 0:
        raise WorkloadError("mean prompt and output tokens must not be negative")
    p_p95 = math.ceil(prompt_mean) if prompt_p95 is None else prompt_p95
    o_p95 = math.ceil(output_mean) if output_p95 is None else output_p95
    if p_p95 < 0 or o_p95 < 0:
        raise WorkloadError("p95 prompt and output tokens must not be negative")
    if prompt_mean + output_mean <= 0:
        raise WorkloadError("a request must have at least one token")
    # Summing the two p95s over-states the p95 of the sum: the safe side for sizing.
    return Workload(prompt_mean, p_p95, output_mean, o_p95, max(1, p_p95 + o_p95))


def from_trace(lines: Iterable[str], *, source: str = "trace") -> Workload:
    """A workload from a trace's lines, in any form `gateway.traces` reads: the planner's JSONL
    (`{"prompt_tokens": P, "output_tokens": O}`), Mooncake JSONL or CSV.

    Blank lines are skipped; any other malformed line raises WorkloadError with its number.
    """
    try:
        trace = parse_trace(lines, source=source)
    except TraceError as exc:
        raise WorkloadError(str(exc)) from None
    return from_requests(trace.requests, source=source)


def from_requests(requests: Sequence[TraceRequest], *, source: str = "trace") -> Workload:
    """A workload from parsed trace requests (at least one)."""
    prompts = [r.input_tokens for r in requests]
    outputs = [r.output_tokens for r in requests]
    if not prompts:
        raise WorkloadError(f"{source}: no requests in the trace")
    totals = [p + o for p, o in zip(prompts, outputs, strict=True)]
    if max(totals) < 1:
        raise WorkloadError(f"{source}: every request has zero tokens")
    return Workload(
        prompt_mean=sum(prompts) / len(prompts),
        prompt_p95=percentile(prompts, 95),
        output_mean=sum(outputs) / len(outputs),
        output_p95=percentile(outputs, 95),
        total_p95=max(1, percentile(totals, 95)),
        requests=len(prompts),
        source=source,
    )


def percentile(values: Sequence[int], pct: float) -> int:
    """Nearest-rank percentile: the smallest value with at least `pct` % of values ≤ it."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]
