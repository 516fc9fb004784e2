"""Aggregates of a run, computed only from its request records (pure).

Percentiles interpolate linearly between ranks (numpy's default, as vLLM's benchmark client).
The measured window runs from the first measured request's send to the last one's end;
warm-up requests are left out of every figure. Goodput counts successful requests that meet
every SLO given (`--slo ttft=500ms,tpot=50ms,e2e=10s`; a bare number is milliseconds).
Refusals are counted per 429 answered, by the error body's `code`, with the time from the
attempt's send to the refusal's head: a refusal decided at once should be as fast as any
other, whatever its reason.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.loadtest.records import OUTCOMES, RequestRecord

PERCENTILES = (50, 90, 95, 99)
SLO_KEYS = ("ttft", "tpot", "e2e")
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(ms|s)?\s*$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def __bool__(self) -> bool:
        return any(x is not None for x in (self.ttft_s, self.tpot_s, self.e2e_s))

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        for limit, value in ((self.ttft_s, r.ttft_s), (self.tpot_s, r.tpot_s or 0.0)):
            if limit is not None and (value is None or value > limit):
                return False
        return self.e2e_s is None or (r.e2e_s is not None and r.e2e_s <= self.e2e_s)

    def describe(self) -> str:
        parts = [
            f"{key}≤{value * 1000:g}ms"
            for key, value in zip(SLO_KEYS, (self.ttft_s, self.tpot_s, self.e2e_s), strict=True)
            if value is not None
        ]
        return ", ".join(parts) or "none"


NO_SLO = Slo()


def parse_slo(spec: str | None) -> Slo:
    """`ttft=500ms,tpot=50,e2e=10s` → Slo; ValueError with a one-line reason otherwise."""
    if not spec:
        return Slo()
    values: dict[str, float] = {}
    for part in spec.split(","):
        key, sep, raw = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo {spec!r}: expected key=value pairs with keys {SLO_KEYS}")
        if key in values:
            raise ValueError(f"--slo {spec!r}: {key} given twice")
        match = _DURATION.match(raw)
        if match is None:
            raise ValueError(f"--slo {spec!r}: {key} needs a positive duration like 500ms or 2s")
        number = float(match.group(1))
        seconds = number if (match.group(2) or "ms").lower() == "s" else number / 1000
        if not seconds > 0 or not math.isfinite(seconds):
            raise ValueError(f"--slo {spec!r}: {key} must be positive")
        values[key] = seconds
    return Slo(values.get("ttft"), values.get("tpot"), values.get("e2e"))


def percentile(values: Sequence[float], pct: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stats_ms(values: Sequence[float]) -> dict[str, float] | None:
    """mean, percentiles, min and max of seconds, in milliseconds (None when empty)."""
    if not values:
        return None
    out = {"mean": sum(values) / len(values) * 1000}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(values, p) * 1000
    out["min"], out["max"] = min(values) * 1000, max(values) * 1000
    return {k: round(v, 3) for k, v in out.items()}


def summarize(records: Iterable[RequestRecord], slo: Slo = NO_SLO) -> dict[str, Any]:
    """Every aggregate of a run, overall and per tenant."""
    measured = [r for r in records if not r.warmup]
    summary = _summary(measured, slo)
    tenants = sorted({r.tenant for r in measured})
    if len(tenants) > 1:
        summary["per_tenant"] = {
            t: _summary([r for r in measured if r.tenant == t], slo) for t in tenants
        }
    return summary


def _summary(measured: list[RequestRecord], slo: Slo) -> dict[str, Any]:
    ok = [r for r in measured if r.ok]
    finished = [r for r in measured if r.outcome != "cancelled"]
    duration = 0.0
    if measured:
        duration = max(r.done_s for r in measured) - min(r.sent_s for r in measured)
    per_s = (lambda n: round(n / duration, 4)) if duration > 0 else (lambda n: 0.0)
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    reasons: dict[str, int] = {}
    for r in measured:
        if not r.ok:
            key = f"{r.outcome}:{r.status}:{r.reason}" if r.reason else f"{r.outcome}:{r.status}"
            reasons[key] = reasons.get(key, 0) + 1
    good = sum(1 for r in ok if slo.met(r)) if slo else len(ok)
    lags = [r.lag_s for r in measured if r.lag_s is not None]
    return {
        "requests": len(measured),
        "outcomes": {o: sum(1 for r in measured if r.outcome == o) for o in OUTCOMES},
        "success_rate": round(len(ok) / len(finished), 4) if finished else 0.0,
        "failures": dict(sorted(reasons.items())),
        "duration_s": round(duration, 4),
        "throughput": {
            "requests_per_s": per_s(len(ok)),
            "output_tokens_per_s": per_s(out_tokens),
            "input_tokens_per_s": per_s(in_tokens),
            "goodput_requests_per_s": per_s(good),
        },
        "slo": slo.describe(),
        "slo_met": good,
        "tokens": {"input": in_tokens, "output": out_tokens},
        "latency_ms": {
            "ttft": stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
            "tpot": stats_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
            "itl": stats_ms([x for r in ok for x in r.itl_s]),
            "e2e": stats_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        },
        "retries": retry_summary(measured),
        "refusals": refusal_summary(measured),
        "send_lag_ms": stats_ms(lags),
    }


def refusal_summary(measured: Sequence[RequestRecord]) -> dict[str, dict[str, Any]]:
    """Every 429 answered (retried attempts included), by its error code: how many, and the
    time to the refusal (`latency_ms`: from the attempt's send to its answer's head)."""
    times: dict[str, list[float]] = {}
    for r in measured:
        for a in r.attempts:
            if a.status == 429 and a.answered_s is not None:
                times.setdefault(a.code or "unknown", []).append(a.answered_s - a.sent_s)
    return {
        code: {"count": len(values), "latency_ms": stats_ms(values)}
        for code, values in sorted(times.items())
    }


def retry_summary(measured: Sequence[RequestRecord]) -> dict[str, Any]:
    """How 429s went: refused at the first try, retried, and how good the advice was.

    `admitted_at_first_retry` is the share of retried requests whose first retry was not
    refused again; `advice_gap_ms` is, for requests admitted after retrying, the time from
    when the first refusal said to come back to when an attempt was admitted (0 when the
    first advice was right).
    """
    first_refused = [r for r in measured if r.attempts and r.attempts[0].status == 429]
    retried = [r for r in measured if len(r.attempts) > 1]
    at_first = [r for r in retried if r.attempts[1].status != 429]
    gaps = []
    for r in retried:
        first = r.attempts[0]
        if r.ok and first.advised_s is not None and first.answered_s is not None:
            advised_at = first.answered_s + first.advised_s
            gaps.append(max(0.0, r.attempts[-1].sent_s - advised_at))
    advised = [a.advised_s for r in measured for a in r.attempts if a.advised_s is not None]
    return {
        "first_try_refused": len(first_refused),
        "retried_requests": len(retried),
        "retries": sum(len(r.attempts) - 1 for r in measured),
        "retried_then_ok": sum(1 for r in retried if r.ok),
        "retried_then_refused": sum(1 for r in retried if r.outcome == "refused"),
        "admitted_at_first_retry": round(len(at_first) / len(retried), 4) if retried else None,
        "advised_ms": stats_ms(advised),
        "advice_gap_ms": stats_ms(gaps),
    }
