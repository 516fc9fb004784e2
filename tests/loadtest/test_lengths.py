from __future__ import annotations

import math
import random
import statistics
from collections import Counter

import pytest

from gateway.loadtest.lengths import Lengths, parse_lengths


@pytest.mark.parametrize(
    ("spec", "mean", "low", "high"),
    [
        ("128", 128, 128, 128),
        ("fixed:7", 7, 7, 7),
        ("uniform:10,20", 15, 10, 20),
        ("loguniform:128,2048", 692.2, 128, 2048),
        ("loguniform:64,512", 215.2, 64, 512),
        ("loguniform:7,7", 7, 7, 7),
        ("normal:100,10", 100, 1, None),
        ("lognormal:100,0.5", 113.3, 1, None),
    ],
)
def test_distributions(spec: str, mean: float, low: int, high: int | None) -> None:
    lengths = parse_lengths(spec)
    rng = random.Random(0)
    values = [lengths.sample(rng) for _ in range(5000)]
    assert statistics.fmean(values) == pytest.approx(mean, rel=0.05)
    assert lengths.mean == pytest.approx(mean, rel=0.01)
    assert min(values) >= low and (high is None or max(values) <= high)


def test_clamped_to_at_least_one_and_at_most_max() -> None:
    rng = random.Random(0)
    assert all(Lengths("normal", 2, 50).sample(rng) >= 1 for _ in range(200))
    assert Lengths("fixed", 900).sample(rng, max_len=100) == 100


@pytest.mark.parametrize(("low", "high"), [(1, 1), (1, 3), (128, 2048), (64, 512), (5, 90_000)])
def test_loguniform_mean_is_the_sum_over_its_values(low: int, high: int) -> None:
    z = math.log((high + 1) / low)
    exact = sum(k * math.log((k + 1) / k) for k in range(low, high + 1)) / z
    assert parse_lengths(f"loguniform:{low},{high}").mean == pytest.approx(exact, rel=1e-9)


def test_loguniform_is_whole_numbers_log_uniform_ends_included() -> None:
    lengths = parse_lengths("loguniform:1,3")
    rng = random.Random(0)
    counts = Counter(lengths.sample(rng) for _ in range(30_000))
    assert set(counts) == {1, 2, 3}
    # P(k) = ln((k + 1) / k) / ln 4: 1/2, 0.29, 0.21
    for k, n in counts.items():
        assert n / 30_000 == pytest.approx(math.log((k + 1) / k) / math.log(4), abs=0.01)
    # As many in each octave: 128..255 as 1024..2047.
    wide = parse_lengths("loguniform:128,2047")
    values = [wide.sample(rng) for _ in range(20_000)]
    low_octave = sum(128 <= v < 256 for v in values)
    high_octave = sum(1024 <= v < 2048 for v in values)
    assert low_octave == pytest.approx(high_octave, rel=0.08)
    assert str(wide) == "loguniform:128,2047"


@pytest.mark.parametrize(
    "spec",
    [
        "0",
        "zipf:3",
        "uniform:9,3",
        "normal:5",
        "normal:5,-1",
        "fixed:x",
        "nan",
        "loguniform:0,8",
        "loguniform:9,3",
        "loguniform:2.5,8",
        "loguniform:8",
        "loguniform:x,8",
    ],
)
def test_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError, match="length"):
        parse_lengths(spec)
