from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.engines.metrics import (
    CacheConfig,
    EngineMetrics,
    MetricsParseError,
    StepCounters,
    parse_metrics,
    parse_page,
    used_blocks_from_usage,
)
from gateway.sim.engine import Engine, EngineLimits, RequestSpec, StepTiming
from gateway.sim.metrics import EngineMetrics as SimMetrics
from tests.engines.pages import (
    IDLE,
    SATURATED,
    add_dp_rank,
    capture,
    drop_series,
    set_label,
    set_value,
)


def only_model(page: str) -> EngineMetrics:
    models = parse_metrics(page)
    assert list(models) == ["tiny"]
    return models["tiny"]


# --- the real captures -------------------------------------------------------------------------


def test_idle_capture_cache_config() -> None:
    cache = parse_page(capture(IDLE)).cache
    assert cache == CacheConfig(
        block_size=128,
        num_gpu_blocks=8192,
        dp_size=1,
        gpu_memory_utilization=0.92,
        cache_dtype="auto",
        enable_prefix_caching=True,
        kv_cache_size_tokens=1_048_576,
        kv_cache_max_concurrency=2048.0,
    )
    assert cache.num_gpu_blocks_per_rank == 8192
    assert cache.usable_blocks == 8191


def test_idle_capture_gauges() -> None:
    tiny = only_model(capture(IDLE))
    assert (tiny.num_requests_running, tiny.num_requests_waiting) == (0, 0)
    assert tiny.kv_cache_usage == 0.0
    assert tiny.num_preemptions_total == 0
    assert (tiny.used_blocks, tiny.free_blocks, tiny.max_rank_free_blocks) == (0, 8191, 8191)


def test_saturated_capture() -> None:
    tiny = only_model(capture(SATURATED))
    # Captured after the 20-request run on the 6-block engine had drained.
    assert tiny.num_requests_running == 0
    assert tiny.num_requests_waiting == 0
    assert tiny.kv_cache_usage == 0.0
    assert tiny.num_preemptions_total == 17
    assert tiny.cache is not None
    assert (tiny.cache.block_size, tiny.cache.num_gpu_blocks) == (128, 6)
    assert tiny.cache.kv_cache_size_tokens == 768
    assert tiny.cache.kv_cache_max_concurrency == 1.5
    # 6 blocks, one of them vLLM's null block: 5 usable.
    assert (tiny.used_blocks, tiny.free_blocks) == (0, 5)


def test_saturated_capture_mid_run_values() -> None:
    # The gauges as the trace of that run saw them at their peak (trace-6blocks-20x200.csv).
    page = capture(SATURATED)
    page = set_value(page, "vllm:num_requests_running", "5.0")
    page = set_value(page, "vllm:num_requests_waiting", "15.0")
    page = set_value(page, "vllm:kv_cache_usage_perc", "1.0")
    tiny = only_model(page)
    assert (tiny.num_requests_running, tiny.num_requests_waiting) == (5, 15)
    assert (tiny.used_blocks, tiny.free_blocks) == (5, 0)


# --- names and shapes across vLLM versions ------------------------------------------------------


def test_older_gpu_cache_usage_perc_name() -> None:
    page = capture(SATURATED).replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    page = set_value(page, "vllm:gpu_cache_usage_perc", "0.6")
    tiny = only_model(page)
    assert tiny.kv_cache_usage == 0.6
    assert tiny.used_blocks == 3  # 0.6 × (6 − 1)


def test_current_name_wins_when_both_present() -> None:
    page = capture(SATURATED)
    page = page.replace(
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.2\n'
        'vllm:gpu_cache_usage_perc{engine="0",model_name="tiny"} 0.8',
    )
    assert only_model(page).kv_cache_usage == 0.2


def test_page_without_engine_label() -> None:
    page = (
        'vllm:num_requests_running{model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{model_name="m"} 1.0\n'
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
        'vllm:num_preemptions_total{model_name="m"} 3.0\n'
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="101"} 1.0\n'
    )
    m = parse_metrics(page)["m"]
    assert (m.num_requests_running, m.num_requests_waiting, m.num_preemptions_total) == (2, 1, 3)
    assert m.used_blocks == 50
    assert m.cache is not None and m.cache.dp_size == 1


def test_unsized_cache_config_gives_no_cache() -> None:
    page = set_label(capture(IDLE), "vllm:cache_config_info", "num_gpu_blocks", "None")
    assert parse_page(page).cache is None
    tiny = only_model(page)
    assert (tiny.used_blocks, tiny.free_blocks, tiny.max_rank_free_blocks) == (None, None, None)


def test_page_without_cache_config() -> None:
    page = drop_series(capture(IDLE), "vllm:cache_config_info")
    assert parse_page(page).cache is None
    assert only_model(page).num_preemptions_total == 0


@pytest.mark.parametrize("engine", ["²", "-1", "rank-a"])
def test_odd_engine_labels_are_kept_as_text(engine: str) -> None:
    page = add_dp_rank(capture(SATURATED), engine)
    assert [r.engine for r in only_model(page).ranks] == [engine, "0"]


def test_empty_page_has_no_models() -> None:
    assert parse_metrics("") == {}
    assert parse_page("").cache is None


# --- data parallelism ---------------------------------------------------------------------------


def dp_page() -> str:
    """The saturated capture as a 2-rank data-parallel server: 6 blocks per rank, 12 in all."""
    page = add_dp_rank(capture(SATURATED), "1")
    page = set_label(page, "vllm:cache_config_info", "num_gpu_blocks", "12")
    for engine, running, waiting, usage, preempted in (
        ("0", "5.0", "3.0", "1.0", "17.0"),
        ("1", "2.0", "0.0", "0.4", "1.0"),
    ):
        page = set_value(page, "vllm:num_requests_running", running, engine)
        page = set_value(page, "vllm:num_requests_waiting", waiting, engine)
        page = set_value(page, "vllm:kv_cache_usage_perc", usage, engine)
        page = set_value(page, "vllm:num_preemptions_total", preempted, engine)
    return page


def test_dp_sums_counts_and_averages_usage() -> None:
    tiny = only_model(dp_page())
    assert [r.engine for r in tiny.ranks] == ["0", "1"]
    assert tiny.num_requests_running == 7
    assert tiny.num_requests_waiting == 3
    assert tiny.num_preemptions_total == 18
    assert tiny.kv_cache_usage == pytest.approx(0.7)


def test_dp_cache_config_is_the_sum_over_ranks() -> None:
    cache = parse_page(dp_page()).cache
    assert cache is not None
    assert (cache.num_gpu_blocks, cache.dp_size) == (12, 2)
    assert cache.num_gpu_blocks_per_rank == 6
    assert (cache.usable_blocks_per_rank, cache.usable_blocks) == (5, 10)


def test_dp_blocks_per_rank() -> None:
    tiny = only_model(dp_page())
    # rank 0: 1.0 × 5 = 5 used, 0 free; rank 1: 0.4 × 5 = 2 used, 3 free.
    assert tiny.used_blocks == 7
    assert tiny.free_blocks == 3
    assert tiny.max_rank_free_blocks == 3


def test_several_models_on_one_page() -> None:
    page = capture(IDLE)
    other = "\n".join(
        ln.replace('model_name="tiny"', 'model_name="other"')
        for ln in page.splitlines()
        if ln.startswith("vllm:num_") and 'model_name="tiny"' in ln
    )
    page = page + other.replace(
        'vllm:num_requests_running{engine="0",model_name="other"} 0.0',
        'vllm:num_requests_running{engine="0",model_name="other"} 4.0',
    )
    page += '\nvllm:kv_cache_usage_perc{engine="0",model_name="other"} 0.25\n'
    models = parse_metrics(page)
    assert sorted(models) == ["other", "tiny"]
    assert models["other"].num_requests_running == 4
    assert models["other"].kv_cache_usage == 0.25
    assert models["tiny"].num_requests_running == 0
    assert models["other"].cache == models["tiny"].cache


# --- used blocks from usage ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("usage", "num_gpu_blocks", "used"),
    [
        (0.0, 6, 0),
        (1.0, 6, 5),
        (0.2, 6, 1),
        (0.6, 6, 3),
        (0.5, 8193, 4096),
        (1.0, 1, 0),  # a pool of only the null block: vLLM reports 0
        (1.0000001, 6, 5),
    ],
)
def test_used_blocks_from_usage(usage: float, num_gpu_blocks: int, used: int) -> None:
    assert used_blocks_from_usage(usage, num_gpu_blocks) == used


@given(st.integers(min_value=2, max_value=2_000_000), st.data())
def test_used_blocks_inverts_vllm_get_usage(num_gpu_blocks: int, data: st.DataObject) -> None:
    used = data.draw(st.integers(min_value=0, max_value=num_gpu_blocks - 1))
    free = (num_gpu_blocks - 1) - used
    usage = 1.0 - (free / (num_gpu_blocks - 1))  # BlockPool.get_usage()
    assert used_blocks_from_usage(usage, num_gpu_blocks) == used


# --- garbage ------------------------------------------------------------------------------------

GAUGES = (
    'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n'
    'vllm:num_requests_waiting{{engine="0",model_name="m"}} 0.0\n'
    'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {usage}\n'
    'vllm:num_preemptions_total{{engine="0",model_name="m"}} 0.0\n'
)


@pytest.mark.parametrize(
    "page",
    [
        "hello world",
        "<html><body>502 Bad Gateway</body></html>",
        '{"object": "list", "data": []}',
        'vllm:num_requests_running{engine="0",model_name="m"} abc',
        'vllm:num_requests_running{engine="0",model_name="m} 1.0',
        "\x00\x01\x02",
        GAUGES.format(running="1.0", usage="1.5"),
        GAUGES.format(running="1.0", usage="NaN"),
        GAUGES.format(running="-1.0", usage="0.1"),
        GAUGES.format(running="+Inf", usage="0.1"),
        GAUGES.format(running="1.0", usage="0.1")
        + 'vllm:cache_config_info{block_size="abc",num_gpu_blocks="6"} 1.0\n',
        GAUGES.format(running="1.0", usage="0.1")
        + 'vllm:cache_config_info{block_size="128",num_gpu_blocks="0"} 1.0\n',
        GAUGES.format(running="1.0", usage="0.1")
        + 'vllm:cache_config_info{block_size="128",num_gpu_blocks="6",'
        'enable_prefix_caching="maybe"} 1.0\n',
    ],
)
def test_garbage_raises_metrics_parse_error(page: str) -> None:
    with pytest.raises(MetricsParseError):
        parse_page(page)


def test_a_partial_page_names_what_it_lacks() -> None:
    # Another vLLM version or another engine: what is there is read, the rest is None.
    page = 'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
    m = parse_metrics(page)["m"]
    assert m.num_requests_running == 1
    assert m.num_requests_waiting is None and m.kv_cache_usage is None
    assert m.num_preemptions_total is None and m.used_blocks is None
    assert m.missing == (
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:cache_config_info",
    )


@given(st.text())
def test_any_text_parses_or_raises_metrics_parse_error(text: str) -> None:
    with contextlib.suppress(MetricsParseError):
        parse_page(text)


@given(st.lists(st.sampled_from(capture(SATURATED).splitlines(keepends=True))))
def test_shuffled_capture_lines_parse_or_raise_metrics_parse_error(lines: list[str]) -> None:
    with contextlib.suppress(MetricsParseError):
        parse_page("".join(lines))


def test_the_process_start_time_is_read_when_the_page_has_it() -> None:
    assert parse_page(capture(IDLE)).started == 1.79602057957e09  # the real capture's
    without = drop_series(capture(IDLE), "process_start_time_seconds")
    assert parse_page(without).started is None


@pytest.mark.parametrize("name", ["metrics-cpu-0.32.txt", "metrics-cpu-0.32-saturated.txt"])
def test_only_the_lines_read_are_parsed_and_they_give_the_whole_pages_samples(name: str) -> None:
    # The page is pre-filtered before prometheus_client's parser (see `_samples`): the samples
    # of the metrics read must be exactly those the parser finds in the whole page.
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.engines import metrics

    text = capture(name)
    whole = {
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in metrics._READ
    }
    filtered = {(s.name, tuple(sorted(s.labels.items())), s.value) for s in metrics._samples(text)}
    assert filtered == whole
    read = {metrics.RUNNING, metrics.PREEMPTIONS, metrics.CACHE_CONFIG_INFO, metrics.STEPS}
    read |= {metrics.STEP_TOKENS, metrics.GENERATED, metrics.DECODE_SECONDS, metrics.DECODE_TOKENS}
    assert {s[0] for s in whole} >= read


# -- the step counters the latency model calibrates from (issue 40) ---------------------------


def test_the_step_counters_are_read_from_a_real_vllm_page() -> None:
    # The capture's own lines: vllm:iteration_tokens_total_count 250, _sum 1825,
    # vllm:generation_tokens_total 250, vllm:inter_token_latency_seconds _count 241,
    # _sum 1.0825360019999266.
    steps = only_model(capture(IDLE)).steps
    assert steps == StepCounters(250.0, 1825.0, 250.0, 1.0825360019999266, 241.0)
    assert steps.prefill_tokens == 1575.0
    assert steps.step_seconds == pytest.approx(1.0825360019999266 / 241)


def test_the_step_counters_are_summed_over_data_parallel_ranks() -> None:
    one = only_model(capture(SATURATED)).steps
    two = only_model(add_dp_rank(capture(SATURATED), "1")).steps
    assert one is not None and two is not None
    assert two == StepCounters(*(2 * getattr(one, f) for f in StepCounters.__slots__))


@pytest.mark.parametrize(
    "series",
    [
        "vllm:iteration_tokens_total_count",
        "vllm:iteration_tokens_total_sum",
        "vllm:generation_tokens_total",
        "vllm:inter_token_latency_seconds_sum",
        "vllm:inter_token_latency_seconds_count",
    ],
)
def test_a_page_without_a_step_counter_has_none_and_is_not_flagged(series: str) -> None:
    model = only_model(drop_series(capture(IDLE), series))
    assert model.steps is None
    assert model.missing == ()  # admission does not need them


def test_a_step_counter_that_is_not_a_count_is_refused() -> None:
    page = set_value(capture(IDLE), "vllm:generation_tokens_total", "-1.0")
    with pytest.raises(MetricsParseError, match="step counters"):
        parse_page(page)


def test_step_counters_only_give_no_model() -> None:
    page = "\n".join(
        line
        for line in capture(IDLE).splitlines()
        if line.startswith(("vllm:iteration_tokens_total_", "vllm:generation_tokens_total"))
    )
    assert parse_page(page + "\n").models == {}


def test_step_counter_deltas_refuse_a_counter_that_went_down() -> None:
    before = StepCounters(10, 100, 40, 0.5, 30)
    after = StepCounters(15, 160, 50, 0.6, 38)
    delta = after.since(before)
    assert delta is not None
    assert (delta.steps, delta.prefill_tokens, delta.decode_tokens) == (5, 50, 8)
    assert delta.step_seconds == pytest.approx(0.1 / 8)
    assert before.since(after) is None  # a restart: every counter went down
    assert StepCounters(15, 160, 50, 0.4, 38).since(before) is None  # one went down
    assert StepCounters(15, 105, 50, 0.6, 38).since(before) is None  # more sampled than processed


def test_the_step_counters_are_read_from_the_simulators_page() -> None:
    # Two requests on a virtual clock: 20- and 40-token prompts, 6 and 3 output tokens,
    # 10 ms a step + 1 ms per prompt token; every step produces a token.
    limits = EngineLimits(num_gpu_blocks=64, max_model_len=512)
    engine = Engine(limits, StepTiming(1.0, 10.0, 0.0))
    page = SimMetrics(model_name="tiny", limits=limits, snapshot=engine.snapshot, started_at=0.0)
    now, steps = 0.0, 0
    engine.add(RequestSpec("a", 20, 6), now)
    engine.add(RequestSpec("b", 40, 3), now)
    while engine.has_work():
        outcome = engine.step(now)
        page.observe_step(outcome)
        steps += bool(outcome.tokens)
        now = outcome.batch.ends_at
    read = only_model(page.render().decode()).steps
    assert read is not None
    assert (read.steps, read.generated, read.prefill_tokens) == (steps, 9, 60)
    assert read.decode_tokens == 7  # every token but each request's first
    # The first step prefilled both (70 ms); then 10 ms a step for each decode token.
    assert read.step_seconds == pytest.approx(0.010)
