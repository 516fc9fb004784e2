"""The SLO capacity search (pure): bisection between 0 and the throughput capacity, driven
here by fake probes instead of runs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.loadtest.capacity import SloSearch


def search_with(probe: Callable[[float], float], search: SloSearch) -> SloSearch:
    """Run the search to the end, `probe(rate)` giving the share of requests that met."""
    while (rate := search.next_rate()) is not None:
        search = search.record(rate, probe(rate))
    return search


def below(boundary: float) -> Callable[[float], float]:
    """A target that meets every SLO up to `boundary` req/s and misses a tenth beyond."""
    return lambda rate: 1.0 if rate <= boundary else 0.9


@given(
    boundary=st.floats(min_value=0.05, max_value=9.9),
    probes=st.integers(min_value=1, max_value=10),
)
def test_monotone_outcomes_find_the_boundary_within_the_probes(
    boundary: float, probes: int
) -> None:
    search = search_with(below(boundary), SloSearch(10.0, max_probes=probes))
    assert len(search.done) == probes and search.next_rate() is None
    assert all(0 < p.rate < 10.0 for p in search.done)
    low, high = search.low, search.high
    assert low <= boundary < high and high - low == pytest.approx(10.0 / 2**probes)
    assert search.capacity == (low if low > 0 else None)


def test_bisection_from_half_the_throughput_capacity() -> None:
    search = search_with(below(7.0), SloSearch(8.0, max_probes=6))
    assert [p.rate for p in search.done] == [4.0, 6.0, 7.0, 7.5, 7.25, 7.125]
    assert [p.passed for p in search.done] == [True, True, True, False, False, False]
    assert search.capacity == 7.0 and (search.low, search.high) == (7.0, 7.125)
    # The same outcomes give the same probes: nothing random in the search.
    assert search_with(below(7.0), SloSearch(8.0, max_probes=6)) == search


def test_start_is_a_fraction_of_the_throughput_capacity() -> None:
    search = SloSearch(10.0, start=0.75)
    assert search.next_rate() == 7.5
    assert search.record(7.5, 1.0).next_rate() == pytest.approx(8.75)
    assert search.record(7.5, 0.5).next_rate() == pytest.approx(3.75)


def test_nothing_passes_means_no_capacity() -> None:
    search = search_with(lambda rate: 0.5, SloSearch(4.0, max_probes=4))
    assert search.capacity is None and search.low == 0.0
    assert [p.rate for p in search.done] == [2.0, 1.0, 0.5, 0.25]


def test_everything_passes_stays_below_the_throughput_capacity() -> None:
    search = search_with(lambda rate: 1.0, SloSearch(4.0, max_probes=3))
    assert search.capacity == 3.5 and search.high == 4.0


@pytest.mark.parametrize(("met", "passed"), [(1.0, True), (0.99, True), (0.9899, False)])
def test_a_probe_passes_at_the_quantile(met: float, passed: bool) -> None:
    assert SloSearch(2.0, quantile=0.99).record(1.0, met).done[0].passed is passed


def test_a_noisy_failure_below_the_boundary_moves_the_answer_down_consistently() -> None:
    # Meets up to 7 req/s, but the probe at 6 is unlucky.
    def noisy(rate: float) -> float:
        return 0.98 if rate == 6.0 else below(7.0)(rate)

    search = search_with(noisy, SloSearch(8.0, max_probes=6))
    assert [p.rate for p in search.done] == [4.0, 6.0, 5.0, 5.5, 5.75, 5.875]
    assert search.capacity == 5.875  # the boundary is 7: a failure below it costs accuracy
    # Every rate that passed is below every rate that failed: no contradiction to resolve.
    passed = [p.rate for p in search.done if p.passed]
    failed = [p.rate for p in search.done if not p.passed]
    assert max(passed) < min(failed) == 6.0


def test_outcomes_recorded_out_of_order_are_judged_conservatively() -> None:
    # A caller probing on its own: 6 passed, 4 failed (noise), 2 passed.
    search = SloSearch(8.0).record(6.0, 1.0).record(4.0, 0.9).record(2.0, 1.0)
    # The highest rate that passed below the lowest that failed, and the next probe between.
    assert search.capacity == 2.0 and search.high == 4.0
    assert search.next_rate() == 3.0
    assert SloSearch(8.0).record(6.0, 1.0).record(4.0, 0.9).capacity is None


def test_the_document_lists_every_probe() -> None:
    search = SloSearch(8.0, max_probes=2).record(4.0, 1.0).record(6.0, 0.95)
    assert search.to_dict() == {
        "requests_per_s": 4.0,
        "quantile": 0.99,
        "throughput_requests_per_s": 8.0,
        "bracket": [4.0, 6.0],
        "probes": [
            {"rate": 4.0, "met": 1.0, "passed": True},
            {"rate": 6.0, "met": 0.95, "passed": False},
        ],
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"upper": 0.0}, "positive throughput"),
        ({"upper": 1.0, "quantile": 0.0}, "quantile"),
        ({"upper": 1.0, "quantile": 1.5}, "quantile"),
        ({"upper": 1.0, "max_probes": 0}, "at least one probe"),
        ({"upper": 1.0, "start": 1.0}, "start"),
    ],
)
def test_bad_searches(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SloSearch(**kwargs)  # type: ignore[arg-type]
