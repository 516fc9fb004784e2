"""The predicted reservation: a window of output lengths, its quantile, and capped blocks."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.admission import NeverFits, Placement, place
from gateway.core.footprint import footprint
from gateway.core.reservation import (
    QUANTILE_PER_MARGIN,
    AdaptivePolicy,
    AdaptiveReservation,
    OutputLengths,
    PredictionPolicy,
    blocks_short,
)
from gateway.core.types import EngineSpec, RequestShape


def lengths(quantile=0.9, window=1000, min_samples=1) -> OutputLengths:
    return OutputLengths(PredictionPolicy(quantile, window, min_samples))


def test_nothing_predicted_before_min_samples():
    seen = lengths(min_samples=3)
    for x in (5, 7):
        seen.observe(x)
        assert seen.predicted() is None
    seen.observe(9)
    assert seen.predicted() == 9


@pytest.mark.parametrize(
    ("quantile", "expected"),
    [(0.1, 10), (0.5, 50), (0.9, 90), (0.95, 100), (1.0, 100)],
)
def test_nearest_rank_quantile(quantile, expected):
    seen = lengths(quantile)
    for x in range(100, 0, -10):  # 100, 90, ..., 10: order of arrival does not matter
        seen.observe(x)
    assert seen.predicted() == expected


def test_the_window_forgets_the_oldest():
    seen = lengths(quantile=1.0, window=3)
    for x in (500, 10, 20, 30):
        seen.observe(x)
    assert len(seen) == 3
    assert seen.predicted() == 30  # 500 left the window


@given(
    st.lists(st.integers(0, 5000), min_size=1, max_size=300),
    st.integers(1, 50),
    st.floats(0.01, 1.0),
)
def test_quantile_is_the_nearest_rank_of_the_window(xs, window, quantile):
    seen = lengths(quantile, window)
    for x in xs:
        seen.observe(x)
    recent = sorted(xs[-window:])
    rank = max(1, math.ceil(round(quantile * len(recent), 9)))
    assert seen.predicted() == recent[rank - 1]
    # at least `quantile` of the window is at or below the prediction
    assert sum(x <= seen.predicted() for x in recent) >= quantile * len(recent) - 1e-9


@pytest.mark.parametrize(
    "bad", [(0.0, 10, 1), (1.5, 10, 1), (0.9, 0, 1), (0.9, 10, 0), (0.9, 10, 11)]
)
def test_policy_rejects_impossible_values(bad):
    with pytest.raises(ValueError):
        PredictionPolicy(*bad)


def test_negative_length_is_refused():
    with pytest.raises(ValueError):
        lengths().observe(-1)


def test_cap_limits_blocks_not_tokens():
    shape = RequestShape((20,), 2000, n=2)
    worst = footprint(shape, 16, 4096)
    capped = footprint(shape, 16, 4096, output_cap=100)
    assert worst.blocks == 2 * math.ceil(2020 / 16)
    assert capped.blocks == 2 * math.ceil(120 / 16)
    assert capped.tokens == worst.tokens == 2 * 2020  # TPM still charges the worst case
    assert footprint(shape, 16, 4096, output_cap=5000) == worst  # a cap above the budget


def test_cap_applies_to_the_budget_left_by_the_context():
    shape = RequestShape((100,), None)  # no max_tokens: up to max_model_len − prompt
    assert footprint(shape, 16, 512).blocks == 32
    assert footprint(shape, 16, 512, output_cap=28).blocks == 8


def spec(name: str, blocks: int) -> EngineSpec:
    return EngineSpec(name, "http://x", frozenset({"m"}), blocks + 1, 16, 8, 4096)


def test_place_reserves_the_cap_but_judges_fit_on_the_worst_case():
    engines = [spec("a", 100), spec("b", 20)]
    shape = RequestShape((16,), 1584)  # worst case 100 blocks: fits `a` only
    placed = place(shape, engines, 1.0, output_cap=48)
    assert isinstance(placed, Placement)
    assert set(placed.needs) == {"a"}  # not `b`, although 4 blocks would fit there
    assert placed.needs["a"].blocks == 4
    too_big = place(RequestShape((16,), 2000), engines, 1.0, output_cap=48)
    assert isinstance(too_big, NeverFits)  # 400 in both modes: it could outgrow any engine


def short(held=2, seqs=1, prompt=10, generated=0, budget=1000, block=16):
    return blocks_short(
        held_blocks=held,
        seqs=seqs,
        prompt_tokens=prompt,
        generated=generated,
        budget=budget,
        block_size=block,
    )


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"generated": 21}, 0),  # 10 + 21 + next = 32 tokens: two blocks suffice
        ({"generated": 22}, 3),  # the third block is needed: 1 missing + 2 ahead
        ({"generated": 22, "seqs": 2, "held": 4}, 6),  # per sequence, times the sequences
        ({"generated": 22, "budget": 30}, 1),  # never past the worst case (40 tokens: 3)
        ({"generated": 100, "held": 3}, 6),  # far behind: 8 needed now, 10 with lookahead
    ],
)
def test_blocks_short_table(kwargs, expected):
    assert short(**kwargs) == expected


@given(
    st.integers(0, 300),
    st.integers(0, 600),
    st.integers(1, 600),
    st.integers(1, 4),
    st.sampled_from([16, 128]),
    st.integers(0, 40),
)
def test_a_topped_up_lease_holds_the_next_token(prompt, generated, budget, seqs, block, held):
    generated = min(generated, budget - 1)  # a sequence still running has budget left
    held *= seqs
    add = short(held=held, seqs=seqs, prompt=prompt, generated=generated, budget=budget,
                block=block)  # fmt: skip
    per_seq = (held + add) // seqs
    assert add >= 0 and add % seqs == 0
    assert per_seq * block >= prompt + generated + 1  # room for the next token
    if add:
        assert per_seq <= math.ceil((prompt + budget) / block)  # never past the worst case


def test_excess_is_the_mean_overshoot_of_the_quantile():
    seen = lengths(0.9)
    for x in range(1, 101):
        seen.observe(x)
    # q = 90; the ten above it overshoot by 1..10: 55 over 100 samples.
    assert seen.excess() == pytest.approx(0.55)
    assert seen.excess(1.0) == 0.0
    seen.observe(1000)  # forgets nothing (window 1000), and the cache must not be stale
    # Now q = 91 (rank 91 of 101): 92..100 overshoot by 1..9, and 1000 by 909.
    assert seen.excess() == pytest.approx((45 + 909) / 101)


def test_excess_is_zero_before_min_samples():
    seen = lengths(min_samples=3)
    seen.observe(5)
    assert seen.excess() == 0.0


@given(
    st.lists(st.integers(0, 2000), min_size=1, max_size=200),
    st.integers(1, 50),
    st.floats(0.05, 1.0),
)
def test_excess_matches_its_definition(xs, window, quantile):
    seen = lengths(quantile, window)
    for x in xs:
        seen.observe(x)
    recent = xs[-window:]
    q = seen.predicted()
    assert q is not None
    assert seen.excess() == pytest.approx(sum(max(0, x - q) for x in recent) / len(recent))


def steer(**kwargs) -> AdaptiveReservation:
    kwargs.setdefault("warmup_requests", 0)
    return AdaptiveReservation(AdaptivePolicy(**kwargs), 0.9)


def test_nothing_moves_during_the_warm_up():
    a = steer(warmup_requests=3, start_margin=6)
    a.observe(completed=1, preemptions=20)  # a cold start's burst: not owed
    a.observe(completed=2, preemptions=5)
    assert a.margin == 6 and a.completed == 3
    a.observe(completed=1, preemptions=1)  # the fourth: steered
    assert a.margin == pytest.approx(6 + 0.1 - 0.1 / 1000)


def test_the_position_moves_margin_then_quantile():
    a = steer(target_per_1000=10, start_margin=6, max_margin=10, step=0.1, min_quantile=0.5)
    assert (a.quantile, a.margin) == (0.9, 6)
    a.observe(preemptions=40)  # +4: the margin's top
    assert (a.quantile, a.margin) == (0.9, pytest.approx(10))
    a.observe(preemptions=5)  # +0.5 beyond it: the quantile rises
    assert a.margin == 10
    assert a.quantile == pytest.approx(0.9 + 0.5 * QUANTILE_PER_MARGIN)
    a.observe(preemptions=1000)
    assert a.quantile == 1.0  # never past the longest recent output
    a.observe(completed=10_000_000)
    assert a.margin == 0 and a.quantile == 0.5  # nor below the floor
    a.observe(preemptions=1)  # held at the end: not owed the time spent there
    assert a.quantile == pytest.approx(0.5 + 0.1 * QUANTILE_PER_MARGIN)


def test_completed_requests_relax_at_the_target_rate():
    a = steer(target_per_1000=10, start_margin=6, step=0.1)
    a.observe(completed=1000)  # 10 preemptions' worth: one unit of position
    assert a.margin == pytest.approx(5)
    a.observe(completed=1000, preemptions=10)  # at the target: stays
    assert a.margin == pytest.approx(5)


def test_a_burst_over_budget_is_paid_back_in_full():
    a = steer(target_per_1000=1, start_margin=6, step=0.1)
    a.observe(preemptions=20)  # +2
    assert a.margin == pytest.approx(8)
    a.observe(completed=19_000)
    assert a.margin > 6
    a.observe(completed=2_000)
    assert a.margin < 6


def test_reserve_is_the_quantile_plus_the_margin_of_excess():
    seen = lengths(0.9)
    for i in range(1000):
        seen.observe(600 if i % 10 == 0 else 50)  # 10 % long answers
    a = steer(start_margin=0)
    assert a.reserve(seen) == 50  # the quantile alone: a short answer
    a.position = 5
    assert a.reserve(seen) == 50 + 5 * 55  # mean excess 0.1 × 550
    a.position = 10
    assert a.reserve(seen) == 600  # 1 / (1 − 0.9) excesses: the long answer
    assert steer().reserve(lengths(min_samples=5)) is None  # nothing learnt yet


def test_policy_checks_its_values():
    for bad in (
        {"target_per_1000": 0},
        {"start_margin": 11, "max_margin": 10},
        {"start_margin": -1},
        {"min_quantile": 0},
        {"step": 0},
        {"warmup_requests": -1},
    ):
        with pytest.raises(ValueError):
            AdaptivePolicy(**bad)


@pytest.mark.parametrize("target", [1.0, 10.0])
def test_adaptive_settles_at_its_target_against_a_toy_engine(target):
    # A toy engine with a long tail: 10 % of answers are 600 tokens, the rest 1-96. A request
    # whose reservation r falls short of a long answer is preempted with a probability that
    # falls as r covers more of it (the short answers' unused room absorbs the growth). The
    # controller must find the reservation where preemptions come at its target, neither
    # pinned at the top (reserve everything) nor beyond its target.
    seen = lengths(0.9)
    for i in range(1000):
        seen.observe(600 if i % 10 == 0 else 1 + i % 96)
    a = steer(target_per_1000=target, start_margin=6, max_margin=10, step=0.1)

    def preemption_rate(reserved: int) -> float:  # per request
        return 0.1 * 0.5 * max(0.0, 1 - reserved / 600) ** 2

    owed = 0.0
    rates = []
    for i in range(400_000):
        owed += preemption_rate(a.reserve(seen))
        seen_now = int(owed)
        owed -= seen_now
        a.observe(completed=1, preemptions=seen_now)
        if i >= 200_000:
            rates.append(preemption_rate(a.reserve(seen)))
    mean = 1000 * sum(rates) / len(rates)
    assert 0.8 * target <= mean <= 1.2 * target
    assert a.reserve(seen) < 600  # not pinned at the top
