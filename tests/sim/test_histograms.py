"""vLLM's latency and size histograms on the simulator's /metrics (issue 40, Deliver 4).

The engine is driven on a virtual clock with known step costs, so every count and sum is exact;
one test drives the step loop with an injected clock (the real-clock path) and two go over
HTTP. What each histogram measures is vLLM 0.32's ``vllm/v1/metrics/stats.py``
(``IterationStats.update_from_output``, ``update_from_finished_request``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.engines.metrics import parse_page
from gateway.sim.engine import Engine, EngineLimits, Finished, RequestSpec, StepTiming
from gateway.sim.histograms import request_tokens_buckets
from gateway.sim.loop import Ended, EngineLoop, Event
from gateway.sim.metrics import EngineMetrics
from tests.sim.conftest import SimFactory, metrics

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "vllm" / "metrics-cpu-0.32.txt"

# vLLM 0.32's histograms and their default buckets: vllm/v1/metrics/loggers.py
# (PrometheusStatLogger.__init__, "Histograms of counts" and "Histogram of timing intervals"),
# buckets from vllm/v1/metrics/buckets.py. Listed here, not read from vLLM: CI runs this
# without vLLM installed. The request-parameter histograms (request_params_n,
# request_params_max_tokens, request_max_num_generation_tokens) are not published.
REQUEST_LATENCY = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TIME_TO_FIRST_TOKEN = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_NUM_PREEMPTIONS = (1, 2, 3, 4, 5, 10, 20)
REQUEST_TOKENS_512 = (1, 2, 5, 10, 20, 50, 100, 200, 500)  # build_1_2_5_buckets(max_model_len)

VLLM_HISTOGRAMS: dict[str, tuple[float, ...]] = {
    "vllm:request_prompt_tokens": REQUEST_TOKENS_512,
    "vllm:request_generation_tokens": REQUEST_TOKENS_512,
    "vllm:iteration_tokens_total": ITERATION_TOKENS,
    "vllm:time_to_first_token_seconds": TIME_TO_FIRST_TOKEN,
    "vllm:inter_token_latency_seconds": INTER_TOKEN_LATENCY,
    "vllm:request_time_per_output_token_seconds": INTER_TOKEN_LATENCY,
    "vllm:e2e_request_latency_seconds": REQUEST_LATENCY,
    "vllm:request_queue_time_seconds": REQUEST_LATENCY,
    "vllm:request_inference_time_seconds": REQUEST_LATENCY,
    "vllm:request_prefill_time_seconds": REQUEST_LATENCY,
    "vllm:request_decode_time_seconds": REQUEST_LATENCY,
    "vllm:request_num_preemptions": REQUEST_NUM_PREEMPTIONS,
    "vllm:request_prefill_kv_computed_tokens": REQUEST_TOKENS_512,
}

# 1 ms per computed prompt token, 10 ms per step: a 20-token prompt takes 30 ms, then 10 ms
# per token.
_ENGINE_LABELS = ("engine", "model_name")
TIMING = StepTiming(prefill_ms_per_token=1.0, decode_ms_base=10.0, decode_ms_per_seq=0.0)


def _histograms(page: str) -> dict[str, tuple[str, frozenset[str], tuple[float, ...]]]:
    """histogram name -> (help text, label names of its samples, bucket bounds but +Inf)."""
    out = {}
    for family in text_string_to_metric_families(page):
        if family.type != "histogram":
            continue
        labels = frozenset(k for s in family.samples for k in s.labels)
        les = [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]
        out[family.name] = (family.documentation, labels, tuple(float(le) for le in les[:-1]))
    return out


class Driven:
    """An engine and its /metrics, stepped on a virtual clock."""

    def __init__(self, limits: EngineLimits, timing: StepTiming = TIMING) -> None:
        self.engine = Engine(limits, timing)
        self.metrics = EngineMetrics(
            model_name="tiny", limits=limits, snapshot=self.engine.snapshot, started_at=0.0
        )
        self.finished: list[Finished] = []
        self.now = 0.0

    def add(self, *specs: RequestSpec) -> None:
        for spec in specs:
            self.engine.add(spec, self.now)

    def step(self) -> None:
        outcome = self.engine.step(self.now)
        self.metrics.observe_step(outcome)
        self.finished.extend(outcome.finished)
        self.now = outcome.batch.ends_at

    def run(self) -> None:
        while self.engine.has_work():
            self.step()

    def page(self) -> dict[str, float]:
        """``{sample name + {other labels}: value}``, engine and model labels left out."""
        out = {}
        for family in text_string_to_metric_families(self.metrics.render().decode()):
            for s in family.samples:
                extra = ",".join(
                    f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in _ENGINE_LABELS
                )
                out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
        return out


def _limits(
    *, block_size: int = 16, max_model_len: int = 512, max_num_seqs: int = 256, budget: int = 2048
) -> EngineLimits:
    return EngineLimits(
        num_gpu_blocks=256,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
    )


def _sum(values: Iterable[float]) -> float:
    return sum(values, 0.0)


def test_the_page_has_vllms_histograms_with_its_names_labels_and_buckets() -> None:
    driven = Driven(_limits())
    ours = _histograms(driven.metrics.render().decode())
    real = _histograms(FIXTURE.read_text())  # a real vLLM 0.32 (CPU) page, max_model_len 512
    assert set(ours) == set(VLLM_HISTOGRAMS)
    for name, buckets in VLLM_HISTOGRAMS.items():
        _, labels, bounds = ours[name]
        assert labels == {"engine", "model_name", "le"}, name
        assert bounds == tuple(map(float, buckets)), name
        assert ours[name] == real[name], name  # same help text, labels and buckets


def test_a_histogram_can_be_hidden() -> None:
    limits = _limits()
    page = EngineMetrics(
        model_name="tiny",
        limits=limits,
        snapshot=Engine(limits).snapshot,
        started_at=0.0,
        hidden=("vllm:inter_token_latency_seconds",),
    ).render()
    assert b"vllm:inter_token_latency_seconds" not in page
    assert b"vllm:time_to_first_token_seconds_bucket" in page


def test_request_token_buckets_follow_max_model_len() -> None:
    assert request_tokens_buckets(512) == REQUEST_TOKENS_512
    assert request_tokens_buckets(2048)[-3:] == (500, 1000, 2000)
    assert request_tokens_buckets(1) == (1,)
    page = Driven(_limits(max_model_len=2048)).metrics.render().decode()
    assert _histograms(page)["vllm:request_prompt_tokens"][2][-1] == 2000.0


def test_one_request_alone_measures_each_interval() -> None:
    driven = Driven(_limits())
    driven.add(RequestSpec("a", 20, 6))
    driven.run()
    m = driven.page()
    # First token after one 30 ms step, then 5 tokens 10 ms apart.
    assert m["vllm:time_to_first_token_seconds_count"] == 1
    assert m["vllm:time_to_first_token_seconds_sum"] == pytest.approx(0.030)
    assert m["vllm:time_to_first_token_seconds_bucket{le=0.04}"] == 1
    assert m["vllm:time_to_first_token_seconds_bucket{le=0.02}"] == 0
    assert m["vllm:inter_token_latency_seconds_count"] == 5  # (n - 1) tokens
    assert m["vllm:inter_token_latency_seconds_sum"] == pytest.approx(5 * 0.010)
    expected = {
        "e2e_request_latency": 0.080,
        "request_queue_time": 0.0,
        "request_prefill_time": 0.030,
        "request_decode_time": 0.050,
        "request_inference_time": 0.080,
        "request_time_per_output_token": 0.010,  # decode / (n - 1)
    }
    for name, seconds in expected.items():
        assert m[f"vllm:{name}_seconds_count"] == 1, name
        assert m[f"vllm:{name}_seconds_sum"] == pytest.approx(seconds), name
    assert m["vllm:request_prompt_tokens_sum"] == 20
    assert m["vllm:request_generation_tokens_sum"] == 6
    assert m["vllm:request_prefill_kv_computed_tokens_sum"] == 20
    assert m["vllm:request_num_preemptions_count"] == 1
    assert m["vllm:request_num_preemptions_sum"] == 0
    # One observation per step with a token: the prompt's 20 with the first, then 1 a step.
    assert m["vllm:iteration_tokens_total_count"] == 6
    assert m["vllm:iteration_tokens_total_sum"] == 20 + 6
    assert m["vllm:iteration_tokens_total_bucket{le=32.0}"] == 6
    assert m["vllm:iteration_tokens_total_bucket{le=1.0}"] == 5


def test_a_one_token_request_has_no_inter_token_latency() -> None:
    driven = Driven(_limits())
    driven.add(RequestSpec("a", 20, 1))
    driven.run()
    m = driven.page()
    assert m["vllm:inter_token_latency_seconds_count"] == 0
    assert m["vllm:request_decode_time_seconds_sum"] == 0
    assert m["vllm:request_time_per_output_token_seconds_count"] == 1  # observed as 0, as vLLM
    assert m["vllm:request_time_per_output_token_seconds_sum"] == 0


def test_queue_time_is_the_wait_beyond_max_num_seqs() -> None:
    driven = Driven(_limits(max_num_seqs=1))
    driven.add(RequestSpec("a", 20, 6), RequestSpec("b", 20, 6))
    driven.run()
    m = driven.page()
    # b waits for a's 80 ms, then runs the same 80 ms.
    assert m["vllm:request_queue_time_seconds_count"] == 2
    assert m["vllm:request_queue_time_seconds_sum"] == pytest.approx(0.080)
    assert m["vllm:request_queue_time_seconds_bucket{le=0.3}"] == 2
    assert m["vllm:time_to_first_token_seconds_sum"] == pytest.approx(0.030 + 0.110)
    assert m["vllm:e2e_request_latency_seconds_sum"] == pytest.approx(0.080 + 0.160)
    assert m["vllm:request_prefill_time_seconds_sum"] == pytest.approx(2 * 0.030)
    assert m["vllm:request_inference_time_seconds_sum"] == pytest.approx(2 * 0.080)
    assert m["vllm:inter_token_latency_seconds_sum"] == pytest.approx(10 * 0.010)


def test_a_chunked_prefill_counts_its_prompt_with_the_first_token() -> None:
    # 8 tokens a step: the prompt takes 18 + 18 + 14 ms, then 2 tokens 10 ms apart.
    driven = Driven(_limits(budget=8))
    driven.add(RequestSpec("a", 20, 3))
    driven.run()
    m = driven.page()
    assert m["vllm:time_to_first_token_seconds_sum"] == pytest.approx(0.050)
    assert m["vllm:request_prefill_time_seconds_sum"] == pytest.approx(0.050)
    # vLLM records a step only when it outputs a token, and a prompt's computed tokens with
    # its first token: 3 observations (not 5 steps), 20 + 3 tokens.
    assert m["vllm:iteration_tokens_total_count"] == 3
    assert m["vllm:iteration_tokens_total_sum"] == 23


def test_prefix_cache_hits_are_not_computed_prefill() -> None:
    prompt = list(range(10, 19))  # 9 tokens: 2 full blocks of 4 can hit, the last is computed
    driven = Driven(_limits(block_size=4))
    driven.add(RequestSpec.of_tokens("a", prompt, [1, 2]))
    driven.run()
    driven.add(RequestSpec.of_tokens("b", prompt, [1, 2]))
    driven.run()
    m = driven.page()
    assert m["vllm:request_prompt_tokens_sum"] == 18
    assert m["vllm:request_prefill_kv_computed_tokens_sum"] == 9 + 1
    assert m["vllm:iteration_tokens_total_sum"] == (9 + 2) + (1 + 2)


def test_under_preemption_the_intervals_add_up() -> None:
    # REAL-VLLM.md's overload: 20 x 200 tokens on 5 usable blocks of 128; requests preempt.
    limits = EngineLimits(num_gpu_blocks=6, block_size=128, max_num_seqs=8, max_model_len=512)
    driven = Driven(limits, StepTiming(0.02, 2.0, 0.2))
    driven.add(*(RequestSpec(f"r{i}", 7, 200) for i in range(20)))
    driven.run()
    m = driven.page()
    done = driven.finished
    assert len(done) == 20 and driven.engine.num_preemptions > 0
    assert m["vllm:request_num_preemptions_sum"] == driven.engine.num_preemptions
    # Queue time ends at the first admission: requests admitted at once and preempted later
    # still waited 0.
    assert any(f.num_preemptions > 0 and f.scheduled_at == 0.0 for f in done)

    def total(name: str) -> float:
        return m[f"vllm:{name}_seconds_sum"]

    assert total("request_queue_time") == pytest.approx(_sum(f.scheduled_at or 0 for f in done))
    # Per request: e2e = queue + inference, inference = prefill + decode, and TTFT plus the
    # inter-token latencies span arrival to last token.
    assert total("e2e_request_latency") == pytest.approx(
        total("request_queue_time") + total("request_inference_time")
    )
    assert total("request_inference_time") == pytest.approx(
        total("request_prefill_time") + total("request_decode_time")
    )
    assert total("time_to_first_token") + total("inter_token_latency") == pytest.approx(
        total("e2e_request_latency")
    )
    assert m["vllm:inter_token_latency_seconds_count"] == 20 * 199
    # A preempted request's recomputation falls inside one inter-token latency.
    assert m["vllm:inter_token_latency_seconds_bucket{le=0.01}"] < 20 * 199


def test_an_aborted_request_is_not_observed_as_finished() -> None:
    driven = Driven(_limits())
    driven.add(RequestSpec("a", 20, 6))
    driven.step()
    driven.step()
    assert driven.engine.abort("a", driven.now) is not None
    m = driven.page()
    assert m["vllm:time_to_first_token_seconds_count"] == 1  # observed when it came
    assert m["vllm:inter_token_latency_seconds_count"] == 1
    assert m["vllm:e2e_request_latency_seconds_count"] == 0  # vLLM's abort records no stats
    assert m["vllm:request_queue_time_seconds_count"] == 0
    assert m["vllm:request_success_total{finished_reason=abort}"] == 1


async def test_the_step_loop_stamps_tokens_with_its_clock() -> None:
    # The loop's sleep overshoots each modelled step by 1 ms; the histograms include it.
    clock = [100.0]

    async def sleep(seconds: float) -> None:
        clock[0] += seconds + 0.001
        await asyncio.sleep(0)

    limits = _limits()
    engine = Engine(limits, TIMING)
    page = EngineMetrics(model_name="tiny", limits=limits, snapshot=engine.snapshot, started_at=0.0)
    loop = EngineLoop(engine, page, clock=lambda: clock[0], sleep=sleep)
    task = asyncio.create_task(loop.run())
    sink: asyncio.Queue[Event] = asyncio.Queue()
    loop.submit(RequestSpec("a", 20, 6), sink)
    async with asyncio.timeout(5):
        while not isinstance(await sink.get(), Ended):
            pass
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    m = {
        s.name: s.value
        for f in text_string_to_metric_families(page.render().decode())
        for s in f.samples
        if "le" not in s.labels
    }
    assert m["vllm:time_to_first_token_seconds_sum"] == pytest.approx(0.031)
    assert m["vllm:inter_token_latency_seconds_sum"] == pytest.approx(5 * 0.011)
    assert m["vllm:e2e_request_latency_seconds_sum"] == pytest.approx(0.031 + 5 * 0.011)


async def test_over_http_the_gateways_parser_still_reads_the_page(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(decode_ms_base=2.0) as url:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 5, "ignore_eos": True}
        assert (await client.post(f"{url}/v1/completions", json=body)).status_code == 200
        text = (await client.get(f"{url}/metrics")).text
        m = await metrics(client, url)
    page = parse_page(text)
    assert page.models["tiny"].num_requests_running == 0
    assert page.cache is not None and page.cache.block_size == 16
    assert m["vllm:time_to_first_token_seconds_count"] == 1
    assert m["vllm:inter_token_latency_seconds_count"] == 4
    assert m["vllm:inter_token_latency_seconds_sum"] >= 4 * 0.002  # real sleeps only overshoot
    assert m["vllm:e2e_request_latency_seconds_count"] == 1
    assert m["vllm:request_generation_tokens_sum"] == 5


async def test_over_http_a_request_beyond_max_num_seqs_queues(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(max_num_seqs=1, decode_ms_base=2.0) as url:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 20, "ignore_eos": True}
        replies = await asyncio.gather(
            *(client.post(f"{url}/v1/completions", json=body) for _ in range(2))
        )
        assert [r.status_code for r in replies] == [200, 200]
        m = await metrics(client, url)
    assert m["vllm:request_queue_time_seconds_count"] == 2
    # The second waited for the first's 20 steps of at least 2 ms.
    assert m["vllm:request_queue_time_seconds_sum"] >= 20 * 0.002
