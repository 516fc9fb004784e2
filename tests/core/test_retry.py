import pytest

from gateway.core.retry import ReleaseRate, RetryAdvice, advise_retry


def test_rate_needs_two_events_and_forgets_old_ones():
    r = ReleaseRate(window_s=10)
    assert r.per_second(0) is None
    r.record(0, 10)
    assert r.per_second(0) is None
    r.record(5, 10)
    assert r.per_second(5) == pytest.approx(20 / 5)
    r.record(20, 4)  # the first two fall out of the window
    assert r.per_second(20) is None


def test_advice_from_rate_and_work_ahead():
    # 40 blocks ahead, 10 free, 5 blocks/s → 6 s
    advice = advise_retry(40, 10, 5.0, fallback_s=2)
    assert advice.seconds == pytest.approx(6.0)
    assert advice.header_seconds == 6 and advice.header_ms == 6000
    assert advise_retry(40, 10, None, fallback_s=2).seconds == 2  # no rate observed yet
    assert advise_retry(5, 10, 5.0, fallback_s=2).header_seconds == 1  # fits already: retry soon


def test_header_rounding():
    assert RetryAdvice(1.2).header_seconds == 2
    assert RetryAdvice(0.1).header_seconds == 1
    assert RetryAdvice(0.1).header_ms == 100
