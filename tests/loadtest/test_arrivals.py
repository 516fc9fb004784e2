"""Arrival schedules (pure): rates, burstiness, ramps, replays — statistical bounds wide
enough for any seed, checked over a few seeds."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from gateway.loadtest.arrivals import Ramp, Rate, Replay


def first(n: int, offsets: object) -> list[float]:
    return list(itertools.islice(offsets, n))  # type: ignore[call-overload]


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise([0.0, *times])]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("burstiness", "cv_low", "cv_high"),
    [(1.0, 0.85, 1.15), (0.25, 1.6, 2.4), (4.0, 0.4, 0.6), (math.inf, 0.0, 1e-9)],
)
def test_rate_and_burstiness(seed: int, burstiness: float, cv_low: float, cv_high: float) -> None:
    n, rate = 4000, 20.0
    times = first(n, Rate(rate, burstiness).offsets(random.Random(seed)))
    assert times == sorted(times) and times[0] > 0
    observed = n / times[-1]
    # The mean of n intervals has a relative sd of cv / sqrt(n): ±10 % is > 4 sd here.
    assert observed == pytest.approx(rate, rel=0.10)
    intervals = gaps(times)
    cv = statistics.pstdev(intervals) / statistics.fmean(intervals)
    assert cv_low <= cv <= cv_high  # gamma of shape b: cv = 1/sqrt(b)


def test_rate_inf_sends_everything_at_once() -> None:
    assert first(5, Rate(math.inf).offsets(random.Random(0))) == [0.0] * 5


def test_ramp_rate_moves_linearly() -> None:
    ramp = Ramp(2.0, 20.0, 60.0, burstiness=math.inf)
    times = first(2000, ramp.offsets(random.Random(0)))
    in_first, in_last = sum(t < 10 for t in times), sum(50 <= t < 60 for t in times)
    # Expected arrivals: ∫ rate over [0,10] = 35, over [50,60] = 185.
    assert in_first == pytest.approx(35, abs=2) and in_last == pytest.approx(185, abs=2)
    assert sum(60 <= t < 70 for t in times) == pytest.approx(200, abs=2)  # then flat at end


def test_replay_scales_and_starts_at_zero() -> None:
    assert list(Replay((1.0, 1.5, 3.0), 0.5).offsets(random.Random(0))) == [0.0, 0.25, 1.0]


@pytest.mark.parametrize(
    "make",
    [lambda: Rate(0), lambda: Rate(1, 0), lambda: Ramp(1, 0, 5), lambda: Replay((0.0,), 0)],
)
def test_impossible_schedules(make: object) -> None:
    with pytest.raises(ValueError):
        make()  # type: ignore[operator]
