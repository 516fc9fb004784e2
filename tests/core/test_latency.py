"""The latency model: TTFT and TPOT from the step model, the online calibration, the registry."""

import math
import pickle
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.latency import (
    BatchSnapshot,
    CalibrationPolicy,
    Calibrator,
    LatencyModels,
    StepCosts,
    StepWork,
    decode_work,
    predict_tpot,
    predict_ttft,
    prefill_after_credit,
    tpot_work,
    ttft_work,
)
from gateway.sim.engine import Engine, EngineLimits, RequestSpec, StepTiming

MS = 1e-3
# The issue's workload: decode 10 ms + 1 ms per running sequence, prefill 0.05 ms per token.
ISSUE = StepCosts(
    base_s=10 * MS, per_seq_s=1 * MS, per_prefill_token_s=0.05 * MS, chunk_tokens=2048
)


def close(a: float, b: float, rel: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


# -- the step model, by hand ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chunk", "decoding", "ahead", "own", "expected"),
    [
        # Idle engine, prompt in one step: one step of one sequence.
        (2048, 0, (), 1000, StepWork(steps=1, seq_steps=1, prefill_tokens=1000, requests=1)),
        # 8 decoding; 3,000 ahead in two prompts, then 1,000: 4,000 tokens at 2,040 a step.
        # Step 1: 8 decoders + A (1,500) + B (540): n = 10. Step 2: A decodes too (9), B's
        # 960 + ours 1,000 = 1,960 ≤ 2,039: n = 11.
        (2048, 8, (1500, 1500), 1000, StepWork(2, 21, 4000, 1)),
        # Budget 10: A fills step 1; A decodes in steps 2 and 3 (budget 9): ours 9 + 1.
        (10, 0, (10,), 10, StepWork(3, 5, 20, 1)),
        # A leaves one token of step 1 to ours, whose 9 others fill step 2 beside A's decode.
        (10, 0, (9,), 10, StepWork(2, 4, 19, 1)),
        # A prompt longer than a step: ⌈5,000 / 2,044⌉ = 3 steps of 4 decoders + itself.
        (2048, 4, (), 5000, StepWork(3, 15, 5000, 1)),
        # Sequences ahead with nothing left to compute are not in the line.
        (2048, 0, (0, 0), 100, StepWork(1, 1, 100, 1)),
    ],
)
def test_ttft_work_by_hand(chunk, decoding, ahead, own, expected):
    assert ttft_work(BatchSnapshot(decoding, ahead), own, chunk) == expected


def test_ttft_seconds_by_hand():
    # The second case above on the issue's engine: 2 × 10 ms + 21 × 1 ms + 4,000 × 0.05 ms.
    batch = BatchSnapshot(decoding=8, prefills_ahead=(1500, 1500))
    assert close(predict_ttft(ISSUE, batch, 1000), 0.020 + 0.021 + 0.200)
    with_overhead = StepCosts(10 * MS, 1 * MS, 0.05 * MS, 2048, overhead_s=5 * MS)
    assert close(predict_ttft(with_overhead, batch, 1000), 0.246)


def test_ttft_is_infinite_when_decoders_take_the_whole_budget():
    costs = StepCosts(10 * MS, 1 * MS, 0.05 * MS, chunk_tokens=16)
    assert ttft_work(BatchSnapshot(decoding=16), 10, 16) is None
    assert predict_ttft(costs, BatchSnapshot(decoding=16), 10) == math.inf
    assert predict_ttft(costs, BatchSnapshot(decoding=15), 10) < math.inf


@pytest.mark.parametrize(
    ("batch", "expected_s"),
    [
        # Alone: 10 ms + 1 ms.
        (BatchSnapshot(0), 0.011),
        # 8 decoding + 2 ahead + itself = 11 sequences.
        (BatchSnapshot(8, (1500, 1500)), 0.021),
        # 200 prefill tokens a step from later requests: one more sequence, 10 ms more.
        (BatchSnapshot(8, (), prefill_per_step=200), 0.010 + 0.010 + 0.010),
    ],
)
def test_tpot_by_hand(batch, expected_s):
    assert close(predict_tpot(ISSUE, batch), expected_s)


def test_tpot_has_no_overhead():
    costs = StepCosts(10 * MS, 1 * MS, 0.05 * MS, 2048, overhead_s=1.0)
    assert close(predict_tpot(costs, BatchSnapshot(0)), 0.011)
    assert tpot_work(BatchSnapshot(3)).requests == 0


@pytest.mark.parametrize(
    ("prompt", "cached_blocks", "block_size", "expected"),
    [
        (100, 0, 16, 100),
        (100, 3, 16, 52),
        (100, 10, 16, 4),  # at most ⌊99 / 16⌋ = 6 blocks can hit
        (16, 1, 16, 16),  # a one-block prompt: its last token is always computed
        (17, 1, 16, 1),
        (1, 0, 16, 1),
    ],
)
def test_prefill_after_credit(prompt, cached_blocks, block_size, expected):
    assert prefill_after_credit(prompt, cached_blocks, block_size) == expected


def test_a_request_computes_at_least_one_token():
    with pytest.raises(ValueError):
        ttft_work(BatchSnapshot(0), 0, 2048)


def test_decode_work_and_sums():
    work = decode_work(steps=99, batch=12.5, prefill_tokens=3000, prefill_seqs=4)
    assert work == StepWork(99, 99 * 12.5 + 4, 3000, 0)
    assert work + StepWork(1, 2, 3, 1) == StepWork(100, 99 * 12.5 + 6, 3003, 1)


@pytest.mark.parametrize(
    "bad",
    [
        dict(base_s=-1e-3),
        dict(per_seq_s=math.nan),
        dict(per_prefill_token_s=math.inf),
        dict(overhead_s=-1.0),
        dict(chunk_tokens=0),
    ],
)
def test_step_costs_refuse_impossible_values(bad):
    fields = dict(base_s=0.01, per_seq_s=0.001, per_prefill_token_s=1e-5, chunk_tokens=2048)
    with pytest.raises(ValueError):
        StepCosts(**(fields | bad))


def test_batch_snapshot_refuses_negative_values():
    for bad in (dict(decoding=-1), dict(decoding=0, prefills_ahead=(5, -1))):
        with pytest.raises(ValueError):
            BatchSnapshot(**bad)
    with pytest.raises(ValueError):
        BatchSnapshot(0, prefill_per_step=math.nan)


# -- monotonicity -----------------------------------------------------------------------------

costs_st = st.builds(
    StepCosts,
    base_s=st.floats(0, 0.1),
    per_seq_s=st.floats(0, 0.01),
    per_prefill_token_s=st.floats(0, 1e-3),
    chunk_tokens=st.integers(1, 4096),
    overhead_s=st.floats(0, 0.1),
)
ahead_st = st.lists(st.integers(0, 6000), max_size=12).map(tuple)


@settings(max_examples=1000, deadline=None)
@given(
    costs_st,
    st.integers(0, 300),
    ahead_st,
    st.integers(1, 8000),
    st.integers(0, 12),
    st.integers(1, 3000),
)
def test_more_prefill_ahead_never_shortens_ttft(costs, decoding, ahead, own, at, more):
    """More steps and more prefill, always; in seconds, never shorter by more than one
    sequence-step per sequence in line: vLLM itself schedules a request that no longer
    straddles a step boundary in one step fewer (the test below)."""
    batch = BatchSnapshot(decoding, ahead)
    before = predict_ttft(costs, batch, own)
    work = ttft_work(batch, own, costs.chunk_tokens)
    longer = list(ahead)
    if ahead:
        longer[at % len(ahead)] += more  # one sequence ahead has more to compute
    else:
        longer.append(more)
    inserted = list(ahead)
    inserted.insert(at % (len(ahead) + 1), more)  # one more sequence ahead
    slack = costs.per_seq_s * (sum(1 for tokens in ahead if tokens > 0) + 1)
    for more_ahead in (tuple(longer), tuple(inserted)):
        after = ttft_work(BatchSnapshot(decoding, more_ahead), own, costs.chunk_tokens)
        if work is None:
            assert after is None
            continue
        if after is None:
            continue
        assert after.steps >= work.steps
        assert after.prefill_tokens > work.prefill_tokens
        assert costs.seconds(after) >= before - slack - 1e-12


def test_one_more_token_ahead_can_shorten_ttft_in_vllm_too():
    """Budget 355: behind 354 tokens our 2 straddle two steps (2 sequences in each); behind
    355 they fit in the second (1 + 2). The simulator agrees, sequence-step for
    sequence-step."""
    costs = StepCosts(0.0, 7.8125 * MS, 0.0, chunk_tokens=355)
    timing = StepTiming(prefill_ms_per_token=0.0, decode_ms_base=0.0, decode_ms_per_seq=7.8125)
    assert ttft_work(BatchSnapshot(0, (354,)), 2, 355) == StepWork(2, 4, 356, 1)
    assert ttft_work(BatchSnapshot(0, (355,)), 2, 355) == StepWork(2, 3, 357, 1)
    for ahead, expected in (((354,), 0.03125), ((355,), 0.0234375)):
        assert close(predict_ttft(costs, BatchSnapshot(0, ahead), 2), expected)
        assert close(_sim_first_token_and_next(timing, 355, 0, ahead, 2)[0], expected)


@settings(max_examples=400, deadline=None)
@given(costs_st, st.integers(0, 300), ahead_st, st.integers(1, 8000), st.integers(1, 50))
def test_more_decoders_never_shorten_ttft(costs, decoding, ahead, own, more):
    before = predict_ttft(costs, BatchSnapshot(decoding, ahead), own)
    assert predict_ttft(costs, BatchSnapshot(decoding + more, ahead), own) >= before
    work = ttft_work(BatchSnapshot(decoding, ahead), own, costs.chunk_tokens)
    after = ttft_work(BatchSnapshot(decoding + more, ahead), own, costs.chunk_tokens)
    if work is not None and after is not None:
        assert after.steps >= work.steps and after.seq_steps >= work.seq_steps


@settings(max_examples=400, deadline=None)
@given(
    costs_st,
    st.integers(0, 300),
    ahead_st,
    st.integers(1, 8000),
    st.integers(0, 600),
    st.integers(0, 600),
    st.sampled_from([16, 32, 128]),
)
def test_prefix_credit_never_lengthens_ttft(costs, decoding, ahead, prompt, fewer, more, bs):
    batch = BatchSnapshot(decoding, ahead)
    less_cached = prefill_after_credit(prompt, fewer, bs)
    more_cached = prefill_after_credit(prompt, fewer + more, bs)
    assert 1 <= more_cached <= less_cached <= prompt
    assert predict_ttft(costs, batch, more_cached) <= predict_ttft(costs, batch, less_cached)


@settings(max_examples=400, deadline=None)
@given(
    costs_st,
    st.integers(0, 300),
    ahead_st,
    st.floats(0, 5000),
    st.integers(0, 50),
    st.integers(0, 5),
    st.floats(0, 2000),
)
def test_a_bigger_batch_never_shortens_tpot(costs, decoding, ahead, rate, more, ahead_more, q):
    before = predict_tpot(costs, BatchSnapshot(decoding, ahead, rate))
    bigger = BatchSnapshot(decoding + more, ahead + (1,) * ahead_more, rate)
    assert predict_tpot(costs, bigger) >= before
    busier = BatchSnapshot(decoding, ahead, rate + q)
    assert predict_tpot(costs, busier) >= before


# -- the model against the simulator ----------------------------------------------------------


def _sim_first_token_and_next(
    timing: StepTiming, chunk: int, decoding: int, ahead: tuple[int, ...], own: int
) -> tuple[float, float]:
    """Run the simulator: `decoding` sequences past their first token, then the sequences
    `ahead` and ours added at t0. Returns our TTFT and our first inter-token time."""
    limits = EngineLimits(
        num_gpu_blocks=4000,
        block_size=128,
        max_num_seqs=512,
        max_num_batched_tokens=chunk,
        max_model_len=40_000,
        enable_prefix_caching=False,
    )
    engine = Engine(limits, timing)
    now = 0.0
    for i in range(decoding):
        engine.add(RequestSpec(f"d{i}", 1, 20_000), now)
    started: set[str] = set()
    while len(started) < decoding:  # until every decoder has its first token
        outcome = engine.step(now)
        now = outcome.batch.ends_at
        started.update(t.request_id for t in outcome.tokens)
    t0 = now
    for i, tokens in enumerate(ahead):
        engine.add(RequestSpec(f"a{i}", tokens, 20_000), now)
    engine.add(RequestSpec("ours", own, 20_000), now)
    first: float | None = None
    while True:
        outcome = engine.step(now)
        now = outcome.batch.ends_at
        for t in outcome.tokens:
            if t.request_id == "ours":
                if first is not None:
                    return first - t0, t.at - first
                first = t.at


@settings(max_examples=60, deadline=None)
@given(
    st.integers(64, 2048),
    st.integers(0, 40),
    st.lists(st.integers(1, 3000), max_size=6).map(tuple),
    st.integers(1, 4000),
    st.floats(0.001, 0.1),
    st.floats(0.5, 20),
    st.floats(0, 2),
)
def test_predictions_match_the_simulator(chunk, decoding, ahead, own, prefill_ms, base, per_seq):
    timing = StepTiming(
        prefill_ms_per_token=prefill_ms, decode_ms_base=base, decode_ms_per_seq=per_seq
    )
    costs = StepCosts(base * MS, per_seq * MS, prefill_ms * MS, chunk)
    ttft, tpot = _sim_first_token_and_next(timing, chunk, decoding, ahead, own)
    batch = BatchSnapshot(decoding, ahead)
    assert math.isclose(predict_ttft(costs, batch, own), ttft, rel_tol=1e-9)
    assert math.isclose(predict_tpot(costs, batch), tpot, rel_tol=1e-9)


# -- calibration ------------------------------------------------------------------------------

TRUE = StepCosts(
    base_s=8 * MS,
    per_seq_s=0.7 * MS,
    per_prefill_token_s=0.04 * MS,
    chunk_tokens=2048,
    overhead_s=3 * MS,
)
WRONG = StepCosts(
    base_s=30 * MS, per_seq_s=0.1 * MS, per_prefill_token_s=0.2 * MS, chunk_tokens=2048
)


def _work(rng: random.Random) -> StepWork:
    """What the gateway sees: half are TTFTs (a few steps of prefill, one overhead), half are
    decode stretches (many steps, others' prefill in some of them)."""
    batch = rng.uniform(1, 64)
    if rng.random() < 0.5:
        steps = rng.randint(1, 4)
        return StepWork(steps, steps * batch + rng.randint(1, 3), rng.uniform(1, 2000) * steps, 1)
    steps = rng.randint(1, 300)
    return decode_work(steps, batch, rng.uniform(0, 600) * steps, rng.randint(0, steps))


def _observe(cal: Calibrator, rng: random.Random, n: int, truth: StepCosts, noise: float = 0.0):
    for _ in range(n):
        work = _work(rng)
        seconds = truth.seconds(work) * (math.exp(rng.gauss(0, noise)) if noise else 1.0)
        assert cal.observe(work, seconds)


def _assert_costs(got: StepCosts, want: StepCosts, rel: float) -> None:
    for name in ("base_s", "per_seq_s", "per_prefill_token_s"):
        assert math.isclose(getattr(got, name), getattr(want, name), rel_tol=rel), name
    assert math.isclose(got.overhead_s, want.overhead_s, rel_tol=rel, abs_tol=rel * MS)
    assert got.chunk_tokens == want.chunk_tokens


REPRESENTATIVE = [
    (BatchSnapshot(decoding, ahead, rate), own)
    for decoding in (0, 8, 32)
    for ahead in ((), (1500,), (800, 2000, 300))
    for rate in (0, 300)
    for own in (100, 1000, 4000)
]


def _prediction_error(got: StepCosts, want: StepCosts) -> float:
    """The largest relative difference of TTFT or TPOT over representative engine states."""
    return max(
        max(
            abs(predict_ttft(got, batch, own) / predict_ttft(want, batch, own) - 1),
            abs(predict_tpot(got, batch) / predict_tpot(want, batch) - 1),
        )
        for batch, own in REPRESENTATIVE
    )


def test_cold_start_uses_the_configured_costs():
    cal = Calibrator(WRONG, CalibrationPolicy(min_observations=20))
    assert cal.costs == WRONG and not cal.calibrated
    _observe(cal, random.Random(1), 19, TRUE)
    assert cal.costs == WRONG and not cal.calibrated
    _observe(cal, random.Random(2), 1, TRUE)
    assert cal.calibrated and cal.costs != WRONG


def test_calibration_recovers_the_coefficients_without_noise():
    cal = Calibrator(WRONG)
    _observe(cal, random.Random(3), 300, TRUE)
    _assert_costs(cal.costs, TRUE, rel=0.01)


def test_calibration_recovers_the_coefficients_with_noise():
    """10 % noise on every observation: the terms that dominate step time are recovered
    within a few percent; the per-request overhead (3 ms inside TTFTs of ~70 ms ± 7 ms) is
    the least determined, and matters least."""
    cal = Calibrator(WRONG, CalibrationPolicy(window=2000))
    _observe(cal, random.Random(4), 6000, TRUE, noise=0.1)
    got = cal.costs
    for name in ("base_s", "per_seq_s", "per_prefill_token_s"):
        assert math.isclose(getattr(got, name), getattr(TRUE, name), rel_tol=0.08), name
    assert abs(got.overhead_s - TRUE.overhead_s) < 1 * MS
    assert _prediction_error(got, TRUE) < 0.06


def test_calibration_from_the_simulators_own_steps():
    timing = StepTiming(prefill_ms_per_token=0.05, decode_ms_base=10.0, decode_ms_per_seq=1.0)
    limits = EngineLimits(num_gpu_blocks=2000, block_size=16, max_num_seqs=32, max_model_len=4096)
    engine = Engine(limits, timing)
    rng = random.Random(5)
    cal = Calibrator(WRONG)
    now, added, target = 0.0, 0, 40
    while cal.observations < 400:
        if cal.observations % 50 == 0:
            target = rng.randint(1, 40)  # light and heavy phases: the batch size varies
        while engine.num_unfinished < target:
            added += 1
            engine.add(RequestSpec(f"r{added}", rng.randint(64, 2048), rng.randint(8, 256)), now)
        outcome = engine.step(now)
        now = outcome.batch.ends_at
        batch = outcome.batch
        cal.observe(StepWork(1, len(batch.scheduled), batch.prefill_tokens), batch.seconds)
    want = StepCosts(10 * MS, 1 * MS, 0.05 * MS, 2048, overhead_s=0.0)
    _assert_costs(cal.costs, want, rel=0.01)


def test_a_constant_batch_teaches_the_step_time_at_that_batch():
    """Base and per-sequence cost cannot be told apart at one batch size: their sum there is
    learned exactly, and neither goes negative."""
    cal = Calibrator(WRONG)
    rng = random.Random(13)
    for _ in range(200):
        work = decode_work(steps=rng.randint(1, 50), batch=24, prefill_tokens=0)
        assert cal.observe(work, TRUE.seconds(work))
    got = cal.costs
    assert close(predict_tpot(got, BatchSnapshot(23)), predict_tpot(TRUE, BatchSnapshot(23)), 1e-6)
    assert got.base_s >= 0 and got.per_seq_s >= 0


def test_a_direction_never_observed_keeps_its_configured_cost():
    cal = Calibrator(WRONG)
    rng = random.Random(6)
    for _ in range(300):  # decode only: no prefill, no per-request overhead
        work = decode_work(steps=rng.randint(1, 50), batch=rng.uniform(1, 64))
        assert cal.observe(work, TRUE.seconds(work))
    got = cal.costs
    assert math.isclose(got.base_s, TRUE.base_s, rel_tol=0.01)
    assert math.isclose(got.per_seq_s, TRUE.per_seq_s, rel_tol=0.01)
    assert got.per_prefill_token_s == WRONG.per_prefill_token_s
    assert got.overhead_s == WRONG.overhead_s


def test_coefficients_never_go_negative():
    truth = StepCosts(base_s=5 * MS, per_seq_s=0.0, per_prefill_token_s=0.0, chunk_tokens=2048)
    cal = Calibrator(WRONG)
    _observe(cal, random.Random(7), 1000, truth, noise=0.2)
    got = cal.costs
    assert min(got.base_s, got.per_seq_s, got.per_prefill_token_s, got.overhead_s) >= 0
    assert math.isclose(got.base_s, truth.base_s, rel_tol=0.1)


@pytest.mark.parametrize(
    ("work", "seconds", "weight"),
    [
        (StepWork(5, 50, 100), math.nan, 1.0),
        (StepWork(5, 50, 100), math.inf, 1.0),
        (StepWork(5, 50, 100), 0.0, 1.0),
        (StepWork(5, 50, 100), -0.1, 1.0),
        (StepWork(math.nan, 50, 100), 0.1, 1.0),
        (StepWork(5, math.inf, 100), 0.1, 1.0),
        (StepWork(5, 50, -1), 0.1, 1.0),
        (StepWork(5, 50, 100, requests=-1), 0.1, 1.0),
        (StepWork(0, 0, 0), 0.1, 1.0),
        (StepWork(5, 50, 100), 0.1, 0.0),
        (StepWork(5, 50, 100), 0.1, math.nan),
        (StepWork(5, 50, 5 * 2048 + 1), 0.1, 1.0),  # more prefill than 5 steps can compute
        (StepWork(1, 1e200, 100), 0.1, 1.0),  # finite, but its square overflows
        (StepWork(5, 50, 100), 0.1, 1e308),  # so does the weight times a feature
    ],
)
def test_garbage_is_refused_and_changes_nothing(work, seconds, weight):
    cal = Calibrator(WRONG)
    _observe(cal, random.Random(8), 100, TRUE)
    before, accepted = cal.costs, cal.observations
    assert not cal.observe(work, seconds, weight)
    assert cal.rejected == 1 and cal.observations == accepted
    assert cal.costs == before


def _fit_with_garbage(garbage: bool, policy: CalibrationPolicy) -> StepCosts:
    cal = Calibrator(WRONG, policy)
    rng, noise = random.Random(9), random.Random(90)
    for i in range(2500):
        work = _work(rng)
        seconds = TRUE.seconds(work) * math.exp(noise.gauss(0, 0.05))
        if garbage and i >= 500 and i % 20 == 0:  # 5 %: a stall of 20×, or a 20× short reading
            seconds *= 20 if i % 40 == 0 else 1 / 20
        cal.observe(work, seconds)
    return cal.costs


def test_outliers_barely_move_the_fit():
    clean = _fit_with_garbage(False, CalibrationPolicy())
    assert _prediction_error(clean, TRUE) < 0.05
    assert _prediction_error(_fit_with_garbage(True, CalibrationPolicy()), clean) < 0.05
    # Without the outlier weight (a ratio nothing exceeds) the same garbage ruins the fit.
    unguarded = _fit_with_garbage(True, CalibrationPolicy(outlier_ratio=1e12))
    assert _prediction_error(unguarded, clean) > 0.3


def test_the_fit_follows_an_engine_that_changed():
    cal = Calibrator(WRONG, CalibrationPolicy(window=200))
    rng = random.Random(10)
    _observe(cal, rng, 400, TRUE)
    slower = StepCosts(12 * MS, 1.05 * MS, 0.06 * MS, 2048, overhead_s=4.5 * MS)  # 1.5×
    _observe(cal, rng, 2000, slower)
    _assert_costs(cal.costs, slower, rel=0.02)


def test_state_is_fixed_size():
    cal = Calibrator(WRONG)
    rng = random.Random(11)
    _observe(cal, rng, 100, TRUE, noise=0.1)
    _ = cal.costs  # a fit cached like any other
    small = len(pickle.dumps(cal))
    _observe(cal, rng, 20_000, TRUE, noise=0.1)
    _ = cal.costs
    assert len(pickle.dumps(cal)) <= small + 16  # counters' ints grow by a few bytes at most
    assert not hasattr(cal, "__dict__")  # slots only: no attribute can be added and grow


@pytest.mark.parametrize(
    "bad",
    [
        dict(window=0.5),
        dict(min_observations=0),
        dict(damping=0.0),
        dict(outlier_ratio=1.0),
        dict(refit_every=0),
    ],
)
def test_policy_refuses_impossible_values(bad):
    with pytest.raises(ValueError):
        CalibrationPolicy(**bad)


# -- the registry -----------------------------------------------------------------------------


def test_registry_starts_each_engine_from_its_configured_costs():
    special = StepCosts(1 * MS, 0.1 * MS, 0.01 * MS, 8192)
    models = LatencyModels(WRONG, per_engine={"gpu-big": special})
    assert models.costs("e1") == WRONG
    assert models.costs("gpu-big") == special
    assert set(models) == {"e1", "gpu-big"}


def test_registry_observes_per_engine():
    models = LatencyModels(WRONG, policy=CalibrationPolicy(min_observations=5))
    rng = random.Random(12)
    for _ in range(50):
        work = _work(rng)
        assert models.observe("e1", work, TRUE.seconds(work))
    assert models.calibrator("e1").observations == 50
    _assert_costs(models.costs("e1"), TRUE, rel=0.01)
    assert models.costs("e2") == WRONG


def test_registry_forgets_engines_that_left():
    models = LatencyModels(WRONG, policy=CalibrationPolicy(min_observations=1))
    for name in ("e1", "e2", "e3"):
        models.observe(name, StepWork(1, 4, 0), 0.02)
    models.retain({"e1", "e3", "e9"})
    assert set(models) == {"e1", "e3"}  # retained engines are not created by retain
    models.forget("e3")
    models.forget("never-seen")
    assert set(models) == {"e1"} and len(models) == 1
    assert models.calibrator("e2").observations == 0  # back: from the configured costs
    assert models.costs("e2") == WRONG


def test_request_prefill_counts_later_sequences_as_cached_only_where_the_engine_caches():
    from gateway.core.latency import request_prefill

    # 100-token prompt, 2 blocks of 16 expected cached: 68 to compute for the first sequence.
    assert request_prefill((100,), 1, 2, 16, caches=True) == 68
    assert request_prefill((100,), 3, 2, 16, caches=True) == 68 + 2 * 16  # then its last block
    assert request_prefill((100,), 3, 2, 16, caches=False) == 3 * 68
    assert request_prefill((100, 40), 1, 0, 16, caches=True) == 140  # the other prompt whole
    assert request_prefill((), 2, 0, 16, caches=True) == 0
