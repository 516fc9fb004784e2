"""The latency book's bookkeeping (gateway/latency.py): what a request would find on an engine,
what each hook observes, and its bounds. A list is the clock; pages are built as values."""

from __future__ import annotations

import math

import pytest

from gateway.config import parse_config
from gateway.core.latency import (
    BatchSnapshot,
    CalibrationPolicy,
    LatencyModels,
    StepCosts,
    decode_work,
    predict_tpot,
    predict_ttft,
    ttft_work,
)
from gateway.core.types import EngineSpec
from gateway.engines.metrics import EngineMetrics, MetricsPage, StepCounters
from gateway.engines.pool import EnginePool
from gateway.latency import LatencyBook
from gateway.runtime import _latency_book

COSTS = StepCosts(0.010, 0.001, 0.0001, chunk_tokens=512, overhead_s=0.005)


def spec(name: str = "e", max_num_seqs: int = 8) -> EngineSpec:
    return EngineSpec(name, f"http://{name}", frozenset({"m"}), 1000, 16, max_num_seqs, 4096)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def book(
    *specs: EngineSpec,
    calibrate: bool = True,
    line: int = 0,
    staged: int = 0,
    min_observations: int = 20,
) -> tuple[LatencyBook, Clock]:
    clock = Clock()
    pool = EnginePool(list(specs) or [spec()], clock=clock, staged_seqs=staged)
    models = LatencyModels(COSTS, policy=CalibrationPolicy(min_observations=min_observations))
    made = LatencyBook(
        models, pool, calibrate=calibrate, clock=clock, foreign_prompt_tokens=100, line=line
    )
    return made, clock


def page(
    running: int | None = 0,
    waiting: int | None = 0,
    *,
    steps: StepCounters | None = None,
    started: float | None = 1.0,
) -> MetricsPage:
    model = EngineMetrics("m", running, waiting, 0.0, 0, None, (), steps=steps)
    return MetricsPage(cache=None, models={"m": model}, started=started)


def observations(b: LatencyBook, engine: str = "e") -> int:
    return b.models.calibrator(engine).observations


# -- the batch a request would find -------------------------------------------------------------


def test_snapshot_follows_sent_first_token_finished_and_dropped() -> None:
    b, _ = book()
    assert b.snapshot("e") == BatchSnapshot(0)
    a = b.sent("e", 100, None)
    c = b.sent("e", 200, None)
    assert b.snapshot("e") == BatchSnapshot(0, (100, 200), b.snapshot("e").prefill_per_step)
    b.first_token(a)
    assert (b.snapshot("e").decoding, b.snapshot("e").prefills_ahead) == (1, (200,))
    b.finished(a, 10)
    assert (b.snapshot("e").decoding, b.snapshot("e").prefills_ahead) == (0, (200,))
    b.dropped(c)
    assert (b.snapshot("e").decoding, b.snapshot("e").prefills_ahead) == (0, ())


def test_ending_a_request_twice_changes_nothing() -> None:
    b, _ = book()
    a = b.sent("e", 100, 0.05)
    b.first_token(a)
    b.finished(a, 5)
    b.dropped(a)
    b.finished(a, 5)
    b.first_token(a)
    other = b.sent("e", 50, None)
    b.dropped(other)
    b.dropped(other)
    assert b.snapshot("e").decoding == 0 and b.snapshot("e").prefills_ahead == ()
    assert b.tightest_tpot("e") is None


def test_a_request_dropped_after_its_first_token_leaves_the_decoders() -> None:
    b, _ = book()
    a = b.sent("e", 100, None)
    b.first_token(a)
    b.dropped(a)
    assert b.snapshot("e").decoding == 0


def test_a_finished_request_that_never_had_its_first_token_is_dropped() -> None:
    b, _ = book()
    a = b.sent("e", 100, None)
    b.finished(a, 10)
    assert b.snapshot("e").prefills_ahead == ()
    assert observations(b) == 0


def test_several_sequences_decode_as_several() -> None:
    b, _ = book()
    a = b.sent("e", 300, None, seqs=3)
    assert b.snapshot("e").prefills_ahead == (300,)
    b.first_token(a)
    assert b.snapshot("e").decoding == 3


def test_tightest_tpot_is_the_smallest_target_in_flight() -> None:
    b, _ = book()
    assert b.tightest_tpot("e") is None
    loose = b.sent("e", 10, 0.1)
    tight = [b.sent("e", 10, 0.05), b.sent("e", 10, 0.05)]
    b.sent("e", 10, None)
    assert b.tightest_tpot("e") == 0.05
    b.first_token(tight[0])
    b.finished(tight[0], 3)
    assert b.tightest_tpot("e") == 0.05  # the other one still runs
    b.dropped(tight[1])
    assert b.tightest_tpot("e") == 0.1
    b.dropped(loose)
    assert b.tightest_tpot("e") is None


def test_engines_are_apart() -> None:
    b, _ = book(spec("e"), spec("f"))
    b.first_token(b.sent("e", 100, 0.05))
    b.sent("f", 7, None)
    assert b.snapshot("e").decoding == 1 and b.snapshot("e").prefills_ahead == ()
    assert b.snapshot("f").decoding == 0 and b.snapshot("f").prefills_ahead == (7,)
    assert b.tightest_tpot("f") is None


def test_an_engine_not_in_the_pool_is_not_followed() -> None:
    b, _ = book()
    a = b.sent("gone", 100, 0.05)
    b.first_token(a)
    b.finished(a, 5)
    assert b.snapshot("gone") == BatchSnapshot(0)
    assert b.tightest_tpot("gone") is None
    assert b.unfollowed == 1
    assert "gone" not in b.models


# -- bounds -------------------------------------------------------------------------------------


def test_requests_followed_are_bounded_by_max_num_seqs_staged_and_the_line() -> None:
    b, _ = book(spec(max_num_seqs=2), line=1, staged=1)  # at most 2 + 1 + 1
    handles = [b.sent("e", 10 + i, 0.05) for i in range(6)]
    assert b.snapshot("e").prefills_ahead == (10, 11, 12, 13)
    assert b.unfollowed == 2
    for h in handles[4:]:  # the handles past the bound are inert
        b.first_token(h)
        b.finished(h, 9)
    assert b.snapshot("e").decoding == 0
    b.dropped(handles[0])
    b.sent("e", 99, None)  # room again
    assert b.snapshot("e").prefills_ahead == (11, 12, 13, 99)


def test_foreign_waiting_requests_enter_as_at_most_max_num_seqs_prefills() -> None:
    b, _ = book(spec(max_num_seqs=4))
    b.scraped("e", page(running=0, waiting=10))
    assert b.snapshot("e").prefills_ahead == (100, 100, 100, 700)


# -- what the engine's page adds ----------------------------------------------------------------


def test_foreign_load_is_the_engines_figures_less_this_books_requests() -> None:
    b, _ = book()
    b.first_token(b.sent("e", 50, None))  # decoding
    b.sent("e", 60, None)  # no first token: taken as waiting in the engine
    b.scraped("e", page(running=4, waiting=3))
    # Foreign: 3 − 1 waiting, 4 − 1 running.
    assert b.snapshot("e") == BatchSnapshot(1 + 3, (60, 100, 100), b.snapshot("e").prefill_per_step)
    # Later own requests are counted at once; the foreign figures wait for the next page.
    b.first_token(b.sent("e", 70, None))
    assert b.snapshot("e").decoding == 2 + 3


def test_own_requests_beyond_the_engines_waiting_are_prefilling_so_running() -> None:
    b, _ = book()
    for tokens in (10, 20, 30):
        b.sent("e", tokens, None)
    b.scraped("e", page(running=2, waiting=1))  # one of ours waits, two prefill
    assert b.snapshot("e").decoding == 0
    assert b.snapshot("e").prefills_ahead == (10, 20, 30)


def test_a_page_without_running_or_waiting_adds_no_foreign_load() -> None:
    b, _ = book()
    b.scraped("e", page(running=None, waiting=None))
    assert b.snapshot("e").decoding == 0 and b.snapshot("e").prefills_ahead == ()


def test_without_its_own_scrapes_the_book_reads_the_pools_figures() -> None:
    # A worker of `serve --workers N` that takes the lead worker's figures: no page reaches
    # its book, the pool has the engine's running and waiting counts.
    b, _ = book()
    state = b.pool.get("e")
    assert state is not None
    state.running, state.waiting = 5, 2
    b.first_token(b.sent("e", 50, None))
    assert b.snapshot("e").decoding == 5
    assert b.snapshot("e").prefills_ahead == (100, 100)


def counters(
    steps: float, prompt: float, generated: float, itl_s: float, itl: float
) -> StepCounters:
    return StepCounters(steps, prompt + generated, generated, itl_s, itl)


def test_each_scrape_interval_is_one_mean_step_observation() -> None:
    b, clock = book(min_observations=1)
    b.scraped("e", page(steps=counters(100, 1000, 400, 1.0, 300)))
    assert observations(b) == 0  # one page: no interval yet
    # 50 steps, 2,000 prompt tokens computed, 200 tokens sampled (190 decode, 1.9 s of ITL).
    clock.now += 1
    b.scraped("e", page(steps=counters(150, 3000, 600, 2.9, 490)))
    assert observations(b) == 1
    assert b.snapshot("e").prefill_per_step == pytest.approx(2000 / 50)
    # Idle since: no steps, prefill rate 0, no observation.
    clock.now += 1
    b.scraped("e", page(steps=counters(150, 3000, 600, 2.9, 490)))
    assert observations(b) == 1
    assert b.snapshot("e").prefill_per_step == 0.0


def test_the_observation_is_the_mean_step() -> None:
    # Steps of exactly 4 sequences and 40 prefill tokens at COSTS: the fit finds that time.
    step = COSTS.step_s(4, 40)
    b, clock = book(min_observations=1)
    total = counters(0, 0, 0, 0.0, 0)
    b.scraped("e", page(steps=total))
    for _ in range(30):
        clock.now += 1
        total = counters(
            total.steps + 10, total.prefill_tokens + 400, total.generated + 40,
            total.decode_seconds + 36 * step, total.decode_tokens + 36,
        )  # fmt: skip
        b.scraped("e", page(steps=total))
    assert b.costs("e").step_s(4, 40) == pytest.approx(step, rel=1e-3)


def test_prefill_of_steps_that_sampled_nothing_is_capped_at_a_steps_room() -> None:
    # 2 steps sampled 2 tokens, 1,500 prompt tokens were computed (most of them in steps
    # that sampled nothing, which `steps` does not count): at most 512 − 1 a step.
    b, clock = book(min_observations=1)
    b.scraped("e", page(steps=counters(0, 0, 0, 0.0, 0)))
    clock.now += 1
    b.scraped("e", page(steps=counters(2, 1500, 2, 0.02, 1)))
    assert b.snapshot("e").prefill_per_step == 511
    assert observations(b) == 1 and b.models.calibrator("e").rejected == 0


def test_an_interval_across_a_restart_is_skipped_and_the_engine_forgotten() -> None:
    b, _ = book(min_observations=1)
    b.scraped("e", page(steps=counters(100, 1000, 400, 1.0, 300), started=1.0))
    b.scraped("e", page(steps=counters(110, 1100, 440, 1.1, 330), started=1.0))
    assert observations(b) == 1
    in_flight = b.sent("e", 100, 0.05)
    # Restarted: smaller counters, another start time. Its costs start again; the requests
    # in flight on the old process are no longer followed.
    b.scraped("e", page(steps=counters(10, 100, 40, 0.1, 30), started=2.0))
    assert observations(b) == 0 and b.skipped_intervals == 1
    assert b.snapshot("e").prefills_ahead == () and b.tightest_tpot("e") is None
    b.first_token(in_flight)
    b.finished(in_flight, 10)  # a handle of the old process changes nothing now
    assert observations(b) == 0 and b.snapshot("e").decoding == 0
    b.scraped("e", page(steps=counters(20, 200, 80, 0.2, 60), started=2.0))
    assert observations(b) == 1


def test_an_interval_where_a_counter_went_down_is_skipped() -> None:
    b, _ = book(min_observations=1)
    b.scraped("e", page(steps=counters(100, 1000, 400, 1.0, 300), started=None))
    b.scraped("e", page(steps=counters(90, 1000, 400, 1.0, 300), started=None))
    assert observations(b) == 0 and b.skipped_intervals == 1
    b.scraped("e", page(steps=counters(95, 1100, 420, 1.1, 310), started=None))
    assert observations(b) == 1


def test_a_page_without_step_counters_observes_nothing() -> None:
    b, _ = book()
    b.scraped("e", page(steps=None))
    b.scraped("e", page(steps=None))
    assert observations(b) == 0 and b.skipped_intervals == 0


# -- what the gateway's own requests teach ------------------------------------------------------


def test_a_streamed_request_gives_a_ttft_and_a_decode_observation() -> None:
    b, clock = book(min_observations=1)
    a = b.sent("e", 300, None)
    clock.now += 0.05
    b.first_token(a)
    assert observations(b) == 1
    clock.now += 0.2
    b.finished(a, 11)
    assert observations(b) == 2


def test_observations_are_the_works_at_sending_and_decode() -> None:
    # Timings made by COSTS themselves: the fit reproduces them (ttft and decode of one
    # request at a time, with different prompts and lengths).
    b, clock = book(min_observations=4)
    for prompt, output in [(100, 20), (400, 5), (50, 40), (300, 12)] * 10:
        work = ttft_work(BatchSnapshot(0), prompt, COSTS.chunk_tokens)
        assert work is not None
        a = b.sent("e", prompt, None)
        clock.now += COSTS.seconds(work)
        b.first_token(a)
        clock.now += COSTS.seconds(decode_work(output - 1, 1))
        b.finished(a, output)
    fitted = b.costs("e")
    for batch, prompt in [(BatchSnapshot(0), 250), (BatchSnapshot(0), 30)]:
        assert predict_ttft(fitted, batch, prompt) == pytest.approx(
            predict_ttft(COSTS, batch, prompt), rel=1e-3
        )
    assert predict_tpot(fitted, BatchSnapshot(0)) == pytest.approx(
        predict_tpot(COSTS, BatchSnapshot(0)), rel=1e-3
    )


def test_one_output_token_gives_no_decode_observation() -> None:
    b, clock = book()
    a = b.sent("e", 100, None)
    clock.now += 0.05
    b.first_token(a)
    clock.now += 0.01
    b.finished(a, 1)
    assert observations(b) == 1  # its TTFT only


def test_several_sequences_are_not_observed() -> None:
    b, clock = book()
    a = b.sent("e", 100, None, seqs=2)
    clock.now += 0.05
    b.first_token(a)
    clock.now += 0.5
    b.finished(a, 40)
    assert observations(b) == 0


def test_a_dropped_request_is_not_observed_after_its_first_token() -> None:
    b, clock = book()
    a = b.sent("e", 100, None)
    clock.now += 0.05
    b.first_token(a)
    clock.now += 0.5
    b.dropped(a)
    b.finished(a, 40)
    assert observations(b) == 1  # its TTFT only


def test_a_whole_answer_is_one_observation_of_both_works() -> None:
    b, clock = book()
    a = b.sent("e", 300, None, streamed=False)
    work = ttft_work(BatchSnapshot(0), 300, COSTS.chunk_tokens)
    assert work is not None
    clock.now += COSTS.seconds(work + decode_work(9, 1))
    b.first_token(a)  # the answer arrived: its first token was not seen
    assert observations(b) == 0
    b.finished(a, 10)
    assert observations(b) == 1
    assert b.models.calibrator("e").rejected == 0


def test_an_answer_not_streamed_decodes_from_its_predicted_first_token() -> None:
    b, clock = book()
    a = b.sent("e", 300, None, streamed=False)
    assert b.snapshot("e").prefills_ahead == (300,)
    clock.now += predict_ttft(COSTS, BatchSnapshot(0), 300) + 1e-6
    assert (b.snapshot("e").decoding, b.snapshot("e").prefills_ahead) == (1, ())
    b.first_token(a)
    assert b.snapshot("e").decoding == 1
    b.finished(a, 10)
    assert b.snapshot("e").decoding == 0


def test_with_calibrate_off_nothing_is_observed() -> None:
    b, clock = book(calibrate=False)
    b.scraped("e", page(steps=counters(100, 1000, 400, 1.0, 300)))
    a = b.sent("e", 300, None)
    clock.now += 0.1
    b.first_token(a)
    clock.now += 0.5
    b.finished(a, 20)
    b.first_token(c := b.sent("e", 10, None, streamed=False))
    b.finished(c, 5)
    b.scraped("e", page(steps=counters(150, 3000, 600, 2.9, 490)))
    assert observations(b) == 0
    assert b.costs("e") == COSTS
    assert b.snapshot("e").prefill_per_step == pytest.approx(40.0)  # still measured


# -- the prefill rate ---------------------------------------------------------------------------


def test_without_recent_scrapes_the_prefill_rate_is_what_this_process_sent() -> None:
    b, clock = book()
    assert b.snapshot("e").prefill_per_step == 0.0
    for _ in range(10):
        b.first_token(b.sent("e", 200, None))
        clock.now += 0.5
    rate = b.snapshot("e").prefill_per_step
    assert 0 < rate <= COSTS.chunk_tokens
    # The fixed point q = r × step(n, q) at the rate sent (~400 tokens/s, decayed).
    clock.now += 100  # forgotten
    assert b.snapshot("e").prefill_per_step == pytest.approx(0.0, abs=1e-3)


def test_a_scrape_rate_goes_stale_after_the_window() -> None:
    b, clock = book()
    b.scraped("e", page(steps=counters(100, 1000, 400, 1.0, 300)))
    clock.now += 1
    b.scraped("e", page(steps=counters(150, 3000, 600, 2.9, 490)))
    assert b.snapshot("e").prefill_per_step == pytest.approx(40.0)
    clock.now += 11  # past rate_window_s (10 s), nothing sent: no prefill expected
    assert b.snapshot("e").prefill_per_step == 0.0


# -- the engines' set ---------------------------------------------------------------------------


def test_retain_and_forget_drop_engines_and_their_costs() -> None:
    b, _ = book(spec("e"), spec("f"), min_observations=1)
    for name in ("e", "f"):
        b.sent(name, 10, 0.05)
        b.scraped(name, page(steps=counters(100, 1000, 400, 1.0, 300)))
        b.scraped(name, page(steps=counters(110, 1100, 440, 1.1, 330)))
    b.retain(["e"])
    assert "f" not in b.models and b.tightest_tpot("f") is None
    assert b.snapshot("f").prefills_ahead == ()
    assert b.tightest_tpot("e") == 0.05
    b.forget("e")
    assert b.tightest_tpot("e") is None and "e" not in b.models


def test_constructor_refuses_what_cannot_be() -> None:
    pool = EnginePool([spec()])
    with pytest.raises(ValueError, match="foreign_prompt_tokens"):
        LatencyBook(LatencyModels(COSTS), pool, foreign_prompt_tokens=0)
    with pytest.raises(ValueError, match="rate_window_s"):
        LatencyBook(LatencyModels(COSTS), pool, rate_window_s=math.nan)


# -- built by the runtime -----------------------------------------------------------------------


def test_the_runtime_builds_a_book_only_when_a_class_has_targets() -> None:
    pool = EnginePool([spec("e"), spec("f")])

    def built(slo: dict[str, object]) -> LatencyBook | None:
        engines = [
            {"url": "http://e", "name": "e", "step_costs": {"base_ms": 30.0}},
            {"url": "http://f", "name": "f"},
        ]
        return _latency_book(parse_config({"engines": engines, "slo": slo}), pool)

    assert built({}) is None
    assert built({"classes": {"batch": {}}}) is None
    made = built({"classes": {"batch": {}, "chat": {"tpot_s": 0.1}}, "calibrate": False})
    assert made is not None and not made.calibrate
    assert made.costs("e").base_s == pytest.approx(0.030)  # its own over slo.step_costs
    assert (
        made.costs("f") == parse_config({"engines": [{"url": "http://f"}]}).slo.step_costs.costs()
    )


def test_releases_forecast_each_followed_request_end_from_its_output_budget():
    """A request decoding ends `max_tokens - 1` steps after its first token at the TPOT a
    request sent now would get; one with no first token yet after its predicted TTFT too;
    one without a known budget is not forecast; one past its forecast counts as ending now.
    Ended requests leave the forecast."""
    b, clock = book(calibrate=False)
    first = b.sent("e", 100, None, max_tokens=11)
    b.first_token(first)  # at 100.0
    unknown = b.sent("e", 100, None)  # no budget: never forecast
    b.first_token(unknown)
    clock.now = 100.02
    waiting = b.sent("e", 200, None, max_tokens=5)  # no first token yet
    tpot = predict_tpot(COSTS, b.snapshot("e"))
    ttft = COSTS.seconds(waiting.work)
    ends = sorted(b.releases("e"))
    assert ends == pytest.approx(sorted([10 * tpot - 0.02, ttft + 4 * tpot]))
    clock.now = 101.0  # long past the first one's forecast
    assert min(b.releases("e")) == 0.0
    b.finished(first, 11)
    b.dropped(waiting)
    assert b.releases("e") == []
    assert b.releases("not-in-the-pool") == []


def test_the_ttft_factor_is_a_high_quantile_of_observed_over_predicted():
    """Streamed requests whose first token comes 1.0-1.4x as late as predicted: after
    `ERRORS_NEEDED` of them the factor is their 95th percentile, never below 1; none while
    fewer were seen or without calibration (no observation is made then)."""
    from gateway.latency import ERRORS_NEEDED

    b, clock = book()
    assert b.ttft_factor("e") == 1.0
    ratios = [1.0 + 0.4 * i / 99 for i in range(100)]
    for i, ratio in enumerate(ratios):
        sent = b.sent("e", 100, None, max_tokens=4)
        clock.now += sent.predicted * ratio
        b.first_token(sent)
        b.finished(sent, 4)
        if i + 1 < ERRORS_NEEDED:
            assert b.ttft_factor("e") == 1.0
    assert b.ttft_factor("e") == pytest.approx(ratios[95], rel=1e-6)
    early, clock2 = book()
    for _ in range(30):  # every first token in half the predicted time: no factor below 1
        sent = early.sent("e", 100, None)
        clock2.now += sent.predicted * 0.5
        early.first_token(sent)
        early.finished(sent, 1)
    assert early.ttft_factor("e") == 1.0
    off, clock3 = book(calibrate=False)
    for _ in range(30):
        sent = off.sent("e", 100, None)
        clock3.now += 1.0
        off.first_token(sent)
    assert off.ttft_factor("e") == 1.0


def test_the_decode_factor_stretches_the_forecast_of_ends():
    """Requests that ran their whole budget 1.2x as long as forecast at their first token:
    after `ERRORS_NEEDED` of them `releases` forecasts ends 1.2x as far; one that stopped
    before its budget (an end of sequence) is not an observation of the forecast."""
    from gateway.latency import ERRORS_NEEDED

    b, clock = book()
    for _ in range(ERRORS_NEEDED):
        sent = b.sent("e", 100, None, max_tokens=11)
        clock.now += 0.01
        b.first_token(sent)
        clock.now += sent.predicted_decode * 1.2
        b.finished(sent, 11)
    stopped = b.sent("e", 100, None, max_tokens=11)
    b.first_token(stopped)
    clock.now += stopped.predicted_decode * 5  # a long one that stopped at 3 tokens
    b.finished(stopped, 3)
    assert b.decode_factor("e") == pytest.approx(1.2)
    running = b.sent("e", 100, None, max_tokens=11)
    b.first_token(running)
    tpot = predict_tpot(b.costs("e"), b.snapshot("e"))  # the costs as calibrated so far
    assert b.releases("e") == pytest.approx([10 * tpot * 1.2])
