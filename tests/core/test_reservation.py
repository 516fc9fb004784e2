"""The predicted reservation: a window of output lengths, its quantile, and capped blocks."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.admission import NeverFits, Placement, place
from gateway.core.footprint import footprint
from gateway.core.reservation import (
    AdaptivePolicy,
    AdaptiveQuantile,
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


def test_adaptive_quantile_tightens_on_preemptions_and_relaxes_when_quiet() -> None:
    steer = AdaptiveQuantile(AdaptivePolicy(target_per_1000=10, min_quantile=0.5, step=0.05), 0.6)
    steer.observe(completed=10, preemptions=3)  # 0.1 allowed, 3 seen: 2.9 over budget
    assert steer.quantile == pytest.approx(0.7)  # a step per whole preemption over budget
    steer.observe(preemptions=1)  # 3.9 over: one more whole one
    assert steer.quantile == pytest.approx(0.75)
    for _ in range(489):
        steer.observe(completed=1)
    assert steer.quantile == pytest.approx(0.75)  # the debt repaid, 0.99 to spare
    steer.observe(completed=1)
    assert steer.quantile == pytest.approx(0.70)  # a whole one to spare: relax a step
    assert steer.allowance == pytest.approx(0.0)  # and spend it
    for _ in range(100):
        steer.observe(preemptions=5)
    assert steer.quantile == 1.0  # never past the longest recent output
    for _ in range(100_000):
        steer.observe(completed=100)
    assert steer.quantile == 0.5  # nor below the floor


def test_a_burst_over_budget_is_not_forgiven() -> None:
    # Twenty preemptions in one scrape, then quiet: the quantile stays up until the twenty
    # are paid for at the target rate (20 × 1,000 requests at 1/1000), then relaxes.
    steer = AdaptiveQuantile(AdaptivePolicy(target_per_1000=1, step=0.02), 0.9)
    steer.observe(completed=1, preemptions=20)
    high = steer.quantile
    assert high == 1.0
    for _ in range(20_000):
        steer.observe(completed=1)
    assert steer.quantile == high
    for _ in range(1_001):
        steer.observe(completed=1)
    assert steer.quantile < high


def test_adaptive_quantile_meets_its_target_against_bursty_preemptions() -> None:
    # A toy engine with a cliff, like a workload with 10 % long answers: reserving below
    # the 0.9 quantile under-reserves every long one, and 30 % of the requests admitted then
    # cause a preemption; the gateway learns of them once per 50 requests (a scrape), as a
    # burst. Above the cliff nothing is preempted. Over a long run the controller must keep
    # to its target (it may probe below the cliff, but pays for each burst), and must not
    # stay pinned at the top either.
    target = 1.0
    steer = AdaptiveQuantile(AdaptivePolicy(target_per_1000=target, step=0.02), 0.95)
    owed = 0.0
    preemptions = 0
    requests = 500_000
    lowest_after_first_burst = 1.0
    for i in range(1, requests + 1):
        if steer.quantile < 0.9 - 1e-9:
            owed += 0.3
        seen = 0
        if i % 50 == 0:
            seen = int(owed)
            owed -= seen
            preemptions += seen
        steer.observe(completed=1, preemptions=seen)
        if preemptions:
            lowest_after_first_burst = min(lowest_after_first_burst, steer.quantile)
    assert preemptions > 0  # it did probe the cliff
    assert 1000 * preemptions / requests <= target
    assert lowest_after_first_burst < 0.92  # and came back down to it after a burst


def test_adaptive_quantile_settles_at_its_target_against_a_simulated_engine() -> None:
    # A toy engine: preemptions per request fall as the reserved quantile rises (a tail of
    # long outputs that outgrow low quantiles). The controller finds where they meet 2/1000.
    steer = AdaptiveQuantile(AdaptivePolicy(target_per_1000=2, step=0.01), 0.6)

    def preemption_rate(q: float) -> float:  # per request
        return 0.05 * (1 - q) ** 2

    owed = 0.0
    rates = []
    for i in range(200_000):
        owed += preemption_rate(steer.quantile)
        seen = int(owed)
        owed -= seen
        steer.observe(completed=1, preemptions=seen)
        if i >= 100_000:
            rates.append(preemption_rate(steer.quantile))
    assert 0.0015 <= sum(rates) / len(rates) <= 0.0025
