"""Tenant limits: token buckets for RPM/TPM, concurrency, KV share, header values."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core import tenants
from gateway.core.tenants import Bucket, TenantRefusal, TenantUsage

NONE = TenantUsage()


def check(usage=NONE, *, conc=None, rpm=None, tpm=None, tokens=0, now=0.0):
    return tenants.check_rates(
        usage, max_concurrency=conc, rpm=rpm, tpm=tpm, tokens=tokens, now=now
    )


def test_no_limits_allow_everything():
    assert check(TenantUsage(in_flight=10**6), tokens=10**9) is None


@pytest.mark.parametrize(
    ("usage", "kwargs", "expected"),
    [
        (TenantUsage(in_flight=2), {"conc": 2}, TenantRefusal("tenant_concurrency")),
        (TenantUsage(in_flight=1), {"conc": 2}, None),
        # 60 rpm refills 1 per second: empty at t=0 → room at t=1.
        (TenantUsage(requests=Bucket(0, 0)), {"rpm": 60}, TenantRefusal("tenant_rpm", 1.0)),
        (TenantUsage(requests=Bucket(0, 0)), {"rpm": 60, "now": 1.0}, None),
        (TenantUsage(requests=Bucket(0.5, 0)), {"rpm": 60}, TenantRefusal("tenant_rpm", 0.5)),
        # 600 tpm refills 10 per second: 50 tokens with 20 in the bucket → 3 s.
        (
            TenantUsage(tokens=Bucket(20, 0)),
            {"tpm": 600, "tokens": 50},
            TenantRefusal("tenant_tpm", 3.0),
        ),
        (TenantUsage(tokens=Bucket(20, 0)), {"tpm": 600, "tokens": 20}, None),
        # More tokens than the whole bucket: never.
        (TenantUsage(), {"tpm": 100, "tokens": 101}, TenantRefusal("tenant_tpm", None)),
        # Concurrency is checked first, then RPM, then TPM.
        (
            TenantUsage(in_flight=1, requests=Bucket(0, 0), tokens=Bucket(0, 0)),
            {"conc": 1, "rpm": 60, "tpm": 60, "tokens": 5},
            TenantRefusal("tenant_concurrency"),
        ),
        (
            TenantUsage(requests=Bucket(0, 0), tokens=Bucket(0, 0)),
            {"rpm": 60, "tpm": 60, "tokens": 5},
            TenantRefusal("tenant_rpm", 1.0),
        ),
        (TenantUsage(), {"rpm": 0}, TenantRefusal("tenant_rpm", None)),
    ],
)
def test_check_rates(usage, kwargs, expected):
    assert check(usage, **kwargs) == expected


def test_charge_and_refund():
    u = tenants.charge(TenantUsage(), rpm=60, tpm=1000, blocks=4, tokens=300, now=10.0)
    assert u == TenantUsage(1, 4, Bucket(59, 10.0), Bucket(700, 10.0))
    # 30 s later 500 tokens have flowed back (capped at 1000); 200 of 300 unused are refunded.
    r = tenants.release(u, tpm=1000, blocks=4, charged=300, used=100, now=40.0)
    assert r.in_flight == 0 and r.blocks == 0
    assert r.tokens == Bucket(1000, 40.0)
    r = tenants.release(u, tpm=1000, blocks=4, charged=300, used=100, now=10.0)
    assert r.tokens == Bucket(900, 10.0)
    # Unknown usage refunds nothing; more than charged leaves debt (at most one bucket deep).
    assert tenants.release(u, tpm=1000, blocks=4, charged=300, used=None, now=10.0).tokens == (
        Bucket(700, 10.0)
    )
    debt = tenants.release(u, tpm=1000, blocks=4, charged=300, used=5000, now=10.0)
    assert debt.tokens == Bucket(-1000, 10.0)


def test_share():
    u = TenantUsage(blocks=8)
    assert tenants.share_allows(u, 2, 10) and not tenants.share_allows(u, 3, 10)
    assert tenants.share_allows(u, 10**6, None)


def test_rate_limit_values():
    u = TenantUsage(requests=Bucket(30.5, 0.0), tokens=Bucket(100, 0.0))
    v = tenants.rate_limit_values(u, rpm=60, tpm=600, now=0.0)
    assert (v.limit_requests, v.remaining_requests, v.reset_requests_s) == (60, 30, 29.5)
    assert (v.limit_tokens, v.remaining_tokens, v.reset_tokens_s) == (600, 100, 50.0)
    assert tenants.rate_limit_values(TenantUsage(), rpm=None, tpm=None, now=0.0) == (
        tenants.RateLimitValues()
    )
    full = tenants.rate_limit_values(TenantUsage(), rpm=5, tpm=None, now=3.0)
    assert (full.remaining_requests, full.reset_requests_s) == (5, 0.0)


def test_forget_full():
    u = TenantUsage(requests=Bucket(59, 0.0), tokens=Bucket(0, 0.0))
    assert tenants.forget_full(u, rpm=60, tpm=600, now=1.0) == TenantUsage(tokens=Bucket(0, 0))
    assert tenants.forget_full(u, rpm=60, tpm=600, now=60.0) == TenantUsage()


ops = st.lists(
    st.tuples(
        st.floats(min_value=0, max_value=5),  # time step
        st.booleans(),  # admit (True) or release the oldest (False)
        st.integers(min_value=0, max_value=400),  # tokens asked
        st.integers(min_value=0, max_value=400),  # tokens used
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, rpm=st.integers(1, 30), tpm=st.integers(1, 1000), conc=st.integers(1, 5))
def test_buckets_never_exceed_capacity_and_refusals_charge_nothing(ops, rpm, tpm, conc):
    usage, now, held = TenantUsage(), 0.0, []
    admitted_at = []
    for step, admit, asked, used in ops:
        now += step
        if admit:
            refusal = check(usage, conc=conc, rpm=rpm, tpm=tpm, tokens=asked, now=now)
            if refusal is None:
                usage = tenants.charge(usage, rpm=rpm, tpm=tpm, blocks=1, tokens=asked, now=now)
                held.append(asked)
                admitted_at.append(now)
            else:
                again = check(usage, conc=conc, rpm=rpm, tpm=tpm, tokens=asked, now=now)
                assert again == refusal  # nothing was charged
                if refusal.retry_after_s is not None:
                    later = now + refusal.retry_after_s + 1e-9
                    after = check(usage, conc=conc, rpm=rpm, tpm=tpm, tokens=asked, now=later)
                    assert after is None or after.code != refusal.code
        elif held:
            charged = held.pop(0)
            usage = tenants.release(
                usage, tpm=tpm, blocks=1, charged=charged, used=min(used, charged), now=now
            )
        assert usage.in_flight == len(held) <= conc
        for bucket, cap in ((usage.requests, rpm), (usage.tokens, tpm)):
            if bucket is not None:
                assert bucket.level_at(cap, now) <= cap
    # Requests admitted within any 60 s window never exceed rpm (plus the refill in it).
    for i, t in enumerate(admitted_at):
        within = [u for u in admitted_at[i:] if u < t + 60]
        assert len(within) <= 2 * rpm


@given(level=st.floats(-100, 100), limit=st.integers(1, 1000), now=st.floats(0, 1000))
def test_seconds_until_full_makes_it_full(level, limit, now):
    b = Bucket(level, 0.0)
    wait = b.seconds_until(limit, limit, now)
    assert b.level_at(limit, now + wait) == pytest.approx(limit)
