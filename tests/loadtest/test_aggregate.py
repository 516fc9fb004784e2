"""Aggregates from records (pure): percentiles as numpy's, SLOs, goodput, retry accounting."""

from __future__ import annotations

import pytest

from gateway.loadtest.aggregate import Slo, parse_slo, percentile, summarize
from gateway.loadtest.records import Attempt, RequestRecord, from_dict


def rec(i: int, **kw: object) -> RequestRecord:
    base: dict[str, object] = {
        "index": i,
        "tenant": "t",
        "api": "chat",
        "stream": True,
        "input_tokens": 10,
        "max_tokens": 5,
        "outcome": "ok",
        "status": 200,
        "sent_s": float(i),
        "done_s": float(i) + 1.0,
        "prompt_tokens": 10,
        "output_tokens": 5,
        "ttft_s": 0.1 * (i + 1),
        "e2e_s": 1.0,
        "tpot_s": 0.02,
        "itl_s": (0.02, 0.03),
        "attempts": (Attempt(float(i), 200, float(i) + 0.1),),
    }
    base.update(kw)
    return RequestRecord(**base)  # type: ignore[arg-type]


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10, 20, 30, 40, 50], 90) == pytest.approx(46.0)
    assert percentile([7], 99) == 7


@pytest.mark.parametrize(
    ("spec", "slo"),
    [
        ("ttft=500ms,tpot=50,e2e=2s", Slo(0.5, 0.05, 2.0)),
        ("TTFT=0.25s", Slo(0.25)),
        ("", Slo()),
    ],
)
def test_parse_slo(spec: str, slo: Slo) -> None:
    assert parse_slo(spec) == slo


@pytest.mark.parametrize("spec", ["ttft", "speed=5", "ttft=-1", "ttft=0", "ttft=1,ttft=2", "e2e=x"])
def test_impossible_slo(spec: str) -> None:
    with pytest.raises(ValueError, match="--slo"):
        parse_slo(spec)


def test_summary_counts_goodput_and_warmup() -> None:
    records = [rec(i) for i in range(10)]
    records[0] = rec(0, warmup=True, ttft_s=99.0)
    records[9] = rec(9, outcome="error", status=500, reason="boom", ttft_s=None)
    s = summarize(records, Slo(ttft_s=0.55))
    assert s["requests"] == 9 and s["outcomes"]["ok"] == 8 and s["outcomes"]["error"] == 1
    assert s["failures"] == {"error:500:boom": 1}
    assert s["duration_s"] == 10 - 1  # first measured send (1) to last end (10)
    assert s["slo_met"] == 4  # ttft 0.2 .. 0.5
    assert s["throughput"]["goodput_requests_per_s"] == pytest.approx(4 / 9, abs=1e-4)
    assert s["latency_ms"]["ttft"]["max"] == pytest.approx(900.0)
    assert s["latency_ms"]["itl"]["mean"] == pytest.approx(25.0)


def test_retry_accounting() -> None:
    refused_then_ok = rec(
        1,
        attempts=(
            Attempt(1.0, 429, 1.1, "queue_full", advised_s=0.5, waited_s=0.5),
            Attempt(1.6, 429, 1.7, "queue_full", advised_s=0.5, waited_s=0.5),
            Attempt(2.2, 200, 2.3),
        ),
    )
    refused_for_good = rec(
        2,
        outcome="refused",
        status=429,
        attempts=(
            Attempt(2.0, 429, 2.1, "queue_full", advised_s=1.0, waited_s=1.0),
            Attempt(3.1, 429, 3.2, "queue_full", advised_s=1.0),
        ),
    )
    at_first_retry = rec(
        3,
        attempts=(Attempt(3.0, 429, 3.0, advised_s=0.2, waited_s=0.2), Attempt(3.2, 200, 3.3)),
    )
    r = summarize([rec(0), refused_then_ok, refused_for_good, at_first_retry])["retries"]
    assert r["first_try_refused"] == 3 and r["retried_requests"] == 3 and r["retries"] == 4
    assert (r["retried_then_ok"], r["retried_then_refused"]) == (2, 1)
    assert r["admitted_at_first_retry"] == pytest.approx(1 / 3, abs=1e-4)
    # Admitted 0.6 s after the first advice said (1.1 + 0.5), and exactly on time.
    assert r["advice_gap_ms"]["max"] == pytest.approx(600.0)
    assert r["advice_gap_ms"]["min"] == pytest.approx(0.0)


def test_refusals_by_code_with_their_time_to_the_429() -> None:
    def refused(i: int, code: str | None, seconds: float, **kw: object) -> RequestRecord:
        attempt = Attempt(float(i), 429, float(i) + seconds, code)
        return rec(i, outcome="refused", status=429, reason=code, attempts=(attempt,), **kw)

    records = [
        rec(0),
        *(refused(i, "slo_unattainable", 0.001 * i) for i in range(1, 11)),
        refused(11, "tenant_rpm", 0.002),
        refused(12, "tenant_rpm", 0.004),
        refused(13, None, 0.5),
        refused(14, "tenant_rpm", 9.0, warmup=True),  # left out, as every warm-up request
        # A retried request: its refused attempt counts, its admitted one does not.
        rec(15, attempts=(Attempt(15.0, 429, 16.0, "queue_timeout", 0.1, 0.1),
                          Attempt(16.1, 200, 16.2))),
    ]  # fmt: skip
    refusals = summarize(records)["refusals"]
    assert list(refusals) == ["queue_timeout", "slo_unattainable", "tenant_rpm", "unknown"]
    assert {code: r["count"] for code, r in refusals.items()} == {
        "queue_timeout": 1, "slo_unattainable": 10, "tenant_rpm": 2, "unknown": 1
    }  # fmt: skip
    slo = refusals["slo_unattainable"]["latency_ms"]
    assert (slo["p50"], slo["p99"], slo["max"]) == pytest.approx((5.5, 9.91, 10.0))
    assert refusals["tenant_rpm"]["latency_ms"]["p99"] == pytest.approx(3.98)
    assert refusals["queue_timeout"]["latency_ms"]["max"] == pytest.approx(1000.0)
    assert summarize([rec(0)])["refusals"] == {}


def test_records_round_trip() -> None:
    r = rec(4, attempts=(Attempt(4.0, 429, 4.1, "x", 0.5, 0.5), Attempt(4.6, 200, 4.7)))
    assert from_dict(r.to_dict()) == r
