import itertools

import pytest

from gateway.core.retry import (
    MAX_RETRY_S,
    PROMISE_GRACE_S,
    PROMISE_TICKS_PER_S,
    ReleaseRate,
    RetryAdvice,
    RetryForecast,
    Room,
)


def test_rate_needs_two_events_and_forgets_old_ones():
    r = ReleaseRate(window_s=10)
    assert r.per_second(0) is None
    r.record(0, 10)
    assert r.per_second(0) is None and r.seqs_per_second(0) is None
    r.record(5, 10, seqs=2)
    assert r.per_second(5) == pytest.approx(20 / 5)
    assert r.seqs_per_second(5) == pytest.approx(3 / 5)
    r.record(20, 4)  # the first two fall out of the window
    assert r.per_second(20) is None


def test_rate_keeps_a_bounded_memory_whatever_the_rate():
    """10,000 releases a second for a whole window: the same rate as one at a time would
    give, kept in at most `BUCKETS + 1` buckets (issue 38: a structure per request must have
    a bound that does not grow with the load)."""
    r = ReleaseRate(window_s=30)
    for i in range(400_000):  # 40 s at 10,000/s: the first 10 s fall out of the window
        r.record(i / 10_000, blocks=3)
    now = 399_999 / 10_000
    assert len(r._buckets) <= ReleaseRate.BUCKETS + 1
    assert r.seqs_per_second(now) == pytest.approx(10_000, rel=0.01)
    assert r.per_second(now) == pytest.approx(30_000, rel=0.01)


def rated(seqs_per_s: float, blocks_per_seq: int, fallback_s: float = 2.0) -> RetryForecast:
    """A forecast whose rate is `seqs_per_s` sequences of `blocks_per_seq` blocks a second."""
    rate = ReleaseRate(window_s=100)
    for i in range(int(seqs_per_s * 10) + 1):
        rate.record(i / seqs_per_s, blocks_per_seq)
    return RetryForecast(rate, fallback_s)


def test_advice_covers_the_line_ahead_at_the_release_rate():
    forecast = rated(seqs_per_s=2.0, blocks_per_seq=5)
    now = 10.0
    # 8 requests (40 blocks) wait ahead; nothing is free: 9 sequences at 2/s = 4.5 s.
    advice = forecast.advise(now, need=Room(1, 5), ahead=Room(8, 40), free=Room(0, 0))
    assert advice.seconds == pytest.approx(4.5, rel=0.05)
    assert advice.header_seconds == 5


def test_refusals_at_the_same_moment_are_spread_in_order_not_sent_back_as_a_herd():
    forecast = rated(seqs_per_s=2.0, blocks_per_seq=5)
    now = 10.0
    advised = [
        forecast.advise(now, need=Room(1, 5), ahead=Room(4, 20), free=Room(0, 0)).seconds
        for _ in range(10)
    ]
    assert advised == sorted(advised)
    gaps = [b - a for a, b in itertools.pairwise(advised)]
    assert all(gap == pytest.approx(0.5, rel=0.05) for gap in gaps)  # one release apart
    # Once a promise is due, it no longer stands ahead.
    assert forecast.promised(now + 100) == Room(0, 0)


def test_never_earlier_than_the_first_expected_release():
    forecast = rated(seqs_per_s=0.5, blocks_per_seq=5)
    # Room on the engines already (the constraint was the line's order): still 1 / rate.
    advice = forecast.advise(10.0, need=Room(1, 5), ahead=Room(0, 0), free=Room(4, 100))
    per_s = forecast.rate.seqs_per_second(10.0)
    assert per_s is not None and advice.seconds == pytest.approx(1 / per_s)
    assert advice.seconds > 1.0  # not the bare minimum a "fits already" answer used to get


def test_without_a_rate_the_fallback_spread_by_the_promises():
    forecast = RetryForecast(ReleaseRate(), fallback_s=2.0)
    first = forecast.advise(0, need=Room(1, 1), ahead=Room(0, 0), free=Room(0, 0))
    second = forecast.advise(0, need=Room(1, 1), ahead=Room(0, 0), free=Room(0, 0))
    unpromised = forecast.advise(
        0, need=Room(1, 1), ahead=Room(0, 0), free=Room(0, 0), promise=False
    )
    assert (first.seconds, second.seconds, unpromised.seconds) == (2.0, 4.0, 6.0)
    assert forecast.promised(0) == Room(2, 2)


def test_header_rounding():
    assert RetryAdvice(1.2).header_seconds == 2
    assert RetryAdvice(0.1).header_seconds == 1
    assert RetryAdvice(0.1).header_ms == 100


def test_a_promise_holds_a_place_in_line_until_claimed_or_lapsed():
    forecast = RetryForecast(ReleaseRate(), fallback_s=2.0)
    forecast.advise(0, need=Room(1, 1), ahead=Room(0, 0), free=Room(0, 0))  # due at 2
    forecast.advise(0, need=Room(1, 1), ahead=Room(0, 0), free=Room(0, 0))  # due at 4
    forecast.advise(0, need=Room(1, 1), ahead=Room(0, 0), free=Room(0, 0), promise=False)
    assert forecast.held_places(1.0) == 2  # ahead of a newcomer; the unpromised holds none
    assert forecast.claim(1.0) is None  # a newcomer before any is due takes no one's place
    assert forecast.held_places(1.0) == 2
    assert forecast.claim(2.0) == 2.0  # the first retry, back when told
    assert forecast.held_places(2.0, claimed=2.0) == 0  # nobody ahead of it
    assert forecast.held_places(2.0) == 1  # the second's place, kept from newcomers
    # The second never comes back: its place is given up after the grace.
    assert forecast.held_places(4.0 + PROMISE_GRACE_S - 0.01) == 1
    assert forecast.held_places(4.0 + PROMISE_GRACE_S) == 0


def test_a_late_retry_waits_behind_the_earlier_ones_only():
    forecast = RetryForecast(ReleaseRate(), fallback_s=1.0)
    due = [forecast.advise(0, need=Room(1, 1), ahead=Room(0, 0), free=Room(0, 0)).seconds
           for _ in range(4)]  # fmt: skip
    assert due == [1.0, 2.0, 3.0, 4.0]
    # Two arrive at 2.1 (the first one late, within its grace): the earliest places go first.
    assert forecast.claim(2.1) == 1.0  # the earliest due place is the one claimed
    assert forecast.claim(2.1) == 2.0
    assert forecast.held_places(2.1, claimed=2.0) == 0
    assert forecast.held_places(2.1) == 2


def test_a_cold_start_counts_generations_of_what_runs():
    # No release seen yet: what runs now (4 sequences, 40 blocks) is taken to end within
    # the fallback's 2 s. 6 ahead + 1 promised + 1 own = 8 sequences: two generations.
    forecast = RetryForecast(ReleaseRate(), fallback_s=2.0)
    running = Room(4, 40)
    first = forecast.advise(
        0, need=Room(1, 10), ahead=Room(6, 60), free=Room(0, 0), running=running
    )
    assert first.seconds == pytest.approx(2.0 * 7 / 4)
    second = forecast.advise(
        0, need=Room(1, 10), ahead=Room(6, 60), free=Room(0, 0), running=running
    )
    assert second.seconds == pytest.approx(2.0 * 8 / 4)
    # Blocks decide when they are the scarcer: 30-block asks, 40 blocks running.
    big = forecast.advise(0, need=Room(1, 30), ahead=Room(0, 0), free=Room(0, 0), running=running)
    assert big.seconds == pytest.approx(2.0 * (20 + 30) / 40)
    # Never sooner than the fallback itself.
    lone = RetryForecast(ReleaseRate(), fallback_s=2.0)
    assert lone.advise(0, need=Room(1, 1), ahead=Room(0, 0), free=Room(0, 0),
                       running=Room(8, 80)).seconds == 2.0  # fmt: skip


def test_a_newcomer_is_kept_out_only_by_the_places_due_while_it_would_wait():
    forecast = rated(seqs_per_s=2.0, blocks_per_seq=5)
    due = [
        10.0 + forecast.advise(10.0, need=Room(1, 5), ahead=Room(0, 0), free=Room(0, 0)).seconds
        for _ in range(6)
    ]  # one release apart
    per_s = forecast.rate.seqs_per_second(10.0)
    assert per_s is not None
    # Through a line of 4 in 4 releases: the places due by then are kept from a newcomer,
    # the later ones not (it would have left the line before they come back).
    kept = forecast.held_places(10.0, line=4)
    assert kept == sum(1 for d in due if d <= 10.0 + 4 / per_s) == 4


def test_a_flood_of_refusals_keeps_bounded_sums_and_places():
    """Issue 38: a promise per refusal lived until due (up to MAX_RETRY_S): a client flooding
    a full line made the forecast grow with its rate. Promises are summed per tick of their
    due time, and no more places are kept than the line has."""
    forecast = RetryForecast(ReleaseRate(), fallback_s=2.0, max_places=8)
    need, none = Room(1, 4), Room(0, 0)
    for i in range(20_000):  # 20,000 refusals within 2 s
        forecast.advise(i / 10_000, need=need, ahead=none, free=none, running=Room(1, 4))
    assert forecast.promised(1.99) == Room(20_000, 80_000)  # every promise still counts
    assert len(forecast._promised) <= MAX_RETRY_S * PROMISE_TICKS_PER_S
    assert len(forecast._places) == 8
    assert forecast.promised(MAX_RETRY_S + 3.0) == Room(0, 0)  # all due: all gone
    assert not forecast._promised and not forecast._ticks
