from __future__ import annotations

import random
import statistics

import pytest

from gateway.loadtest.lengths import Lengths, parse_lengths


@pytest.mark.parametrize(
    ("spec", "mean", "low", "high"),
    [
        ("128", 128, 128, 128),
        ("fixed:7", 7, 7, 7),
        ("uniform:10,20", 15, 10, 20),
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


@pytest.mark.parametrize(
    "spec", ["0", "zipf:3", "uniform:9,3", "normal:5", "normal:5,-1", "fixed:x", "nan"]
)
def test_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError, match="length"):
        parse_lengths(spec)
