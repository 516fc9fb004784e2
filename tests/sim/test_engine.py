"""The pure scheduler model: block accounting, admission, preemption, abort."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.sim.engine import Engine, EngineError, EngineLimits, RequestSpec, StepTiming


def _engine(**kw: int) -> Engine:
    limits = dict(num_gpu_blocks=9, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    limits.update(kw)
    limits.setdefault("max_model_len", 32)
    return Engine(EngineLimits(**limits), StepTiming(1.0, 1.0, 1.0))


def _run_until_idle(engine: Engine, now: float = 0.0, limit: int = 10_000) -> float:
    for _ in range(limit):
        if not engine.has_work():
            return now
        now = engine.step(now).batch.ends_at
    raise AssertionError("engine did not go idle")


def test_a_request_holds_ceil_tokens_over_block_size_as_it_grows() -> None:
    engine = _engine()
    engine.add(RequestSpec("a", num_prompt_tokens=5, num_output_tokens=10), 0.0)
    seen = []
    now = 0.0
    while engine.has_work():
        batch = engine.begin_step(now)
        view = engine.requests()[0]
        # Blocks are taken for the tokens computed in this step, before it runs.
        assert view.num_blocks == -(-(view.num_tokens) // 4)
        seen.append(view.num_blocks)
        now = engine.end_step(batch).batch.ends_at
    # KV of prompt 5 + 9 fed-back tokens = 14 tokens -> 4 blocks at most.
    assert seen[0] == 2 and seen[-1] == 4 and seen == sorted(seen)
    assert engine.used_blocks == 0


def test_null_block_is_not_usable_and_usage_is_over_the_rest() -> None:
    engine = _engine(num_gpu_blocks=9)  # 8 usable
    engine.add(RequestSpec("a", 8, 1), 0.0)  # 2 blocks
    engine.begin_step(0.0)
    assert engine.used_blocks == 2
    assert engine.kv_cache_usage() == pytest.approx(2 / 8)


def test_at_most_floor_usable_over_k_run_and_the_rest_wait() -> None:
    engine = _engine(num_gpu_blocks=9)  # 8 usable, each prompt needs 3 blocks
    for i in range(5):
        engine.add(RequestSpec(f"r{i}", 12, 2), 0.0)
    engine.begin_step(0.0)
    snap = engine.snapshot()
    assert (snap.running, snap.waiting, snap.used_blocks) == (2, 3, 6)


def test_admission_stops_at_first_that_does_not_fit() -> None:
    engine = _engine(num_gpu_blocks=9)  # 8 usable
    engine.add(RequestSpec("small", 4, 2), 0.0)  # 1 block
    engine.add(RequestSpec("big", 28, 2), 0.0)  # 7 blocks: 1 + 7 = 8 fits
    engine.add(RequestSpec("tiny", 1, 2), 0.0)  # no block left: waits
    engine.begin_step(0.0)
    assert [v.request_id for v in engine.requests() if v.status == "running"] == [
        "small",
        "big",
    ]
    engine2 = _engine(num_gpu_blocks=9)
    engine2.add(RequestSpec("a", 16, 2), 0.0)  # 4 blocks
    engine2.add(RequestSpec("b", 24, 2), 0.0)  # 6 blocks: does not fit
    engine2.add(RequestSpec("c", 4, 2), 0.0)  # would fit, but FCFS blocks it
    engine2.begin_step(0.0)
    assert engine2.snapshot().running == 1


def test_max_num_seqs_and_token_budget_bound_admission() -> None:
    engine = _engine(num_gpu_blocks=65, max_num_seqs=3, max_model_len=64)
    for i in range(5):
        engine.add(RequestSpec(f"r{i}", 4, 2), 0.0)
    engine.begin_step(0.0)
    assert engine.snapshot().running == 3

    engine = _engine(num_gpu_blocks=65, max_num_batched_tokens=10, max_model_len=64)
    for i in range(5):
        engine.add(RequestSpec(f"r{i}", 4, 2), 0.0)
    batch = engine.begin_step(0.0)
    # 4 + 4 + a 2-token chunk of the third prompt (chunked prefill).
    assert [n for _, n in batch.scheduled] == [4, 4, 2]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    limits = EngineLimits(9, 4, 8, max_num_batched_tokens=32, max_model_len=32)
    engine = Engine(
        EngineLimits(limits.num_gpu_blocks, 4, 8, 32, max_model_len=32, chunked_prefill=False)
    )
    engine.add(RequestSpec("a", 20, 2), 0.0)
    engine.add(RequestSpec("b", 20, 2), 0.0)
    batch = engine.begin_step(0.0)
    assert [rid for rid, _ in batch.scheduled] == ["a"]


def test_growth_without_free_block_preempts_the_newest() -> None:
    engine = _engine(num_gpu_blocks=4, max_model_len=12)  # 3 usable
    for rid in ("old", "mid", "new"):
        engine.add(RequestSpec(rid, 4, 8), 0.0)  # 1 block each, grow to 3
    outcome = engine.step(0.0)
    assert {t.request_id for t in outcome.tokens} == {"old", "mid", "new"}
    # Next step each needs a second block (KV 5 tokens): "old" preempts "new", then "mid"
    # is itself the newest and is preempted.
    batch = engine.begin_step(1.0)
    assert batch.preempted == ("new", "mid")
    assert [v.request_id for v in engine.requests()] == ["old", "mid", "new"]
    assert [v.status for v in engine.requests()] == ["running", "preempted", "preempted"]
    assert engine.num_preemptions == 2
    engine.end_step(batch)
    _run_until_idle(engine, batch.ends_at)
    assert engine.finished_counts["length"] == 3
    assert engine.generation_tokens == 24
    assert engine.prompt_tokens == 12  # recomputation is not counted again


def test_abort_frees_blocks_even_mid_step() -> None:
    engine = _engine()
    engine.add(RequestSpec("a", 8, 5), 0.0)
    engine.add(RequestSpec("b", 8, 5), 0.0)
    batch = engine.begin_step(0.0)
    assert engine.used_blocks == 4
    finished = engine.abort("a", 0.5)
    assert finished is not None and finished.reason == "abort"
    assert engine.used_blocks == 2
    outcome = engine.end_step(batch)
    assert [t.request_id for t in outcome.tokens] == ["b"]
    assert engine.abort("a", 0.6) is None
    engine.abort("b", 0.7)
    assert engine.used_blocks == 0 and not engine.has_work()
    assert engine.finished_counts["abort"] == 2


def test_finish_reasons_and_first_token_time() -> None:
    engine = Engine(EngineLimits(9, 4, 8, 64, max_model_len=32), StepTiming(0.0, 10.0, 0.0))
    engine.add(RequestSpec("s", 3, 2, finish_reason="stop"), 0.0)
    first = engine.step(0.0)
    assert first.tokens[0].at == pytest.approx(0.010)
    second = engine.step(first.batch.ends_at)
    (done,) = second.finished
    assert done.reason == "stop" and done.num_output_tokens == 2
    assert done.first_token_at == pytest.approx(0.010)


def test_step_duration_follows_the_timing_model() -> None:
    engine = Engine(EngineLimits(65, 4, 8, 64, max_model_len=64), StepTiming(0.5, 3.0, 1.0))
    engine.add(RequestSpec("a", 10, 3), 0.0)
    engine.add(RequestSpec("b", 6, 3), 0.0)
    prefill = engine.step(0.0).batch
    assert prefill.seconds == pytest.approx((16 * 0.5 + 3.0 + 2 * 1.0) / 1000)
    decode = engine.step(prefill.ends_at).batch
    assert decode.prefill_tokens == 0
    assert decode.seconds == pytest.approx((3.0 + 2 * 1.0) / 1000)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(num_gpu_blocks=4, block_size=4, max_model_len=16), "null block"),
        (dict(num_gpu_blocks=0), ">= 1"),
    ],
)
def test_limits_are_validated(kw: dict[str, int], message: str) -> None:
    with pytest.raises(EngineError, match=message):
        EngineLimits(**kw)


def test_requests_are_validated() -> None:
    engine = _engine()
    with pytest.raises(EngineError, match="max_model_len"):
        engine.add(RequestSpec("a", 30, 3), 0.0)
    engine.add(RequestSpec("a", 3, 3), 0.0)
    with pytest.raises(EngineError, match="duplicate"):
        engine.add(RequestSpec("a", 3, 3), 0.0)


_request = st.tuples(
    st.integers(1, 40),  # prompt
    st.integers(1, 40),  # output
    st.floats(0, 0.2),  # arrival offset
    st.booleans(),  # aborted at some point
)


@settings(max_examples=150, deadline=None)
@given(
    requests=st.lists(_request, min_size=1, max_size=25),
    num_gpu_blocks=st.integers(21, 60),
    block_size=st.sampled_from([1, 2, 4, 16]),
    max_num_seqs=st.integers(1, 10),
    budget=st.integers(1, 100),
    chunked=st.booleans(),
    caching=st.booleans(),
)
def test_invariants_hold_under_any_load(
    requests: list[tuple[int, int, float, bool]],
    num_gpu_blocks: int,
    block_size: int,
    max_num_seqs: int,
    budget: int,
    chunked: bool,
    caching: bool,
) -> None:
    max_model_len = 80
    limits = EngineLimits(
        num_gpu_blocks=max(num_gpu_blocks, -(-max_model_len // block_size) + 1),
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget if chunked else max(budget, max_model_len),
        max_model_len=max_model_len,
        chunked_prefill=chunked,
        enable_prefix_caching=caching,  # specs without token ids share no block either way
    )
    engine = Engine(limits, StepTiming(0.1, 1.0, 0.1))
    arrivals = sorted(
        (at, f"r{i}", prompt, output, aborted)
        for i, (prompt, output, at, aborted) in enumerate(requests)
    )
    ended: dict[str, str] = {}
    now = 0.0
    pending = list(arrivals)
    steps = 0
    while pending or engine.has_work():
        while pending and pending[0][0] <= now:
            at, rid, prompt, output, _ = pending.pop(0)
            engine.add(RequestSpec(rid, prompt, output), at)
        if not engine.has_work():
            now = pending[0][0]
            continue
        batch = engine.begin_step(now)
        snap = engine.snapshot()
        assert 0 <= snap.used_blocks <= limits.num_gpu_blocks - 1
        assert snap.running <= limits.max_num_seqs
        assert sum(v.num_blocks for v in engine.requests()) == snap.used_blocks
        assert batch.scheduled, "work but nothing scheduled"
        # Abort the flagged requests once they have produced something or are waiting.
        if steps % 3 == 0:
            for _, rid, _, _, aborted in arrivals:
                if aborted and rid not in ended and engine.blocks_of(rid) is not None:
                    f = engine.abort(rid, now)
                    assert f is not None
                    ended[rid] = f.reason
        for f in engine.end_step(batch).finished:
            assert f.request_id not in ended
            ended[f.request_id] = f.reason
        now = batch.ends_at
        steps += 1
        assert steps < 100_000
    assert set(ended) == {rid for _, rid, _, _, _ in arrivals}
    assert engine.used_blocks == 0 and engine.kv_cache_usage() == 0.0
    assert sum(engine.finished_counts.values()) == len(arrivals)
