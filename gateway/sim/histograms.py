"""vLLM's request and step histograms for a simulated engine, observed from step outcomes.

Names, help texts, labels (``engine``, ``model_name``) and default buckets are vLLM 0.32's
(``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger.__init__``; buckets from
``vllm/v1/metrics/buckets.py``). What each one measures follows ``vllm/v1/metrics/stats.py``
(``IterationStats.update_from_output`` and ``update_from_finished_request``):

* per output token: the time to first token (arrival → first token), then the inter-token
  latency (previous token → this one; a preemption's recomputation falls inside one);
* per step that produced a token: the tokens it processed (the prompt tokens computed by the
  requests whose first token came, counted then, plus one per generated token);
* per request that finished (``stop`` or ``length``; an aborted request is not observed, as
  vLLM's abort path records no finished-request stats): end-to-end (arrival → end), queue
  (arrival → first admission), prefill (first admission → first token), decode (first → last
  token), inference (first admission → last token), mean time per output token (decode /
  (tokens − 1), 0 for one token), preemptions, prompt, generated and computed prompt tokens.

The request-parameter histograms (``vllm:request_params_n``, ``vllm:request_params_max_tokens``,
``vllm:request_max_num_generation_tokens``) are not published: the engine model never sees the
parameters. A histogram here is a list of counts, not a ``prometheus_client.Histogram``: one
event loop observes and renders, so an observation needs no lock, only a bisect (a few hundred
nanoseconds, against over a microsecond), and it renders as prometheus_client renders its own.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gateway.sim.engine import Finished, StepOutcome

# vllm/v1/metrics/buckets.py, vLLM 0.32.
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's ``build_1_2_5_buckets(max_model_len)``: 1, 2, 5, 10, 20, 50, … ≤ max_model_len."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


class _Histogram:
    """One series: counts per bucket (not cumulative), the count and the sum."""

    __slots__ = ("_bounds", "_counts", "_les", "_sum", "documentation", "name")

    def __init__(self, name: str, documentation: str, buckets: Iterable[float]) -> None:
        self.name = name
        self.documentation = documentation
        self._bounds = tuple(float(b) for b in buckets)
        self._les: tuple[str, ...] = tuple(
            floatToGoString(b)  # type: ignore[no-untyped-call]
            for b in (*self._bounds, math.inf)
        )
        self._counts = [0] * (len(self._bounds) + 1)  # the last one is +Inf
        self._sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound falls in that bound's bucket (le = "≤").
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    def family(self, labels: dict[str, str], created: float) -> Metric:
        family = Metric(self.name, self.documentation, "histogram")
        cumulative = 0.0
        for le, count in zip(self._les, self._counts, strict=True):
            cumulative += count
            family.add_sample(f"{self.name}_bucket", {**labels, "le": le}, cumulative)
        family.add_sample(f"{self.name}_count", labels, cumulative)
        family.add_sample(f"{self.name}_sum", labels, self._sum)
        family.add_sample(f"{self.name}_created", labels, created)
        return family


class EngineHistograms(Collector):
    """vLLM's latency and size histograms of one engine; ``observe_step`` after every step."""

    def __init__(self, labels: dict[str, str], *, max_model_len: int, created: float) -> None:
        self._labels = dict(labels)
        self._created = created
        tokens = request_tokens_buckets(max_model_len)
        latency = REQUEST_LATENCY_BUCKETS
        itl = INTER_TOKEN_LATENCY_BUCKETS
        self._prompt_tokens = _Histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self._generation_tokens = _Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self._iteration_tokens = _Histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self._ttft = _Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self._itl = _Histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", itl
        )
        self._tpot = _Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            itl,
        )
        self._e2e = _Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            latency,
        )
        self._queue = _Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            latency,
        )
        self._inference = _Histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            latency,
        )
        self._prefill = _Histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            latency,
        )
        self._decode = _Histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            latency,
        )
        self._preemptions = _Histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS,
        )
        self._prefill_kv_computed = _Histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tokens,
        )
        # vLLM's order on the page.
        self._all = (
            self._prompt_tokens,
            self._generation_tokens,
            self._iteration_tokens,
            self._ttft,
            self._itl,
            self._tpot,
            self._e2e,
            self._queue,
            self._inference,
            self._prefill,
            self._decode,
            self._preemptions,
            self._prefill_kv_computed,
        )

    def observe_step(self, outcome: StepOutcome) -> None:
        """Observe one step's tokens and finished requests (called once per step)."""
        if outcome.tokens:  # vLLM records a step's stats only when it has outputs
            ttft, itl = self._ttft.observe, self._itl.observe
            for token in outcome.tokens:
                (ttft if token.index == 0 else itl)(token.at - token.since)
            self._iteration_tokens.observe(outcome.prompt_tokens_computed + len(outcome.tokens))
        for finished in outcome.finished:
            if finished.reason != "abort":
                self._observe_finished(finished)

    def _observe_finished(self, f: Finished) -> None:
        assert f.scheduled_at is not None and f.first_token_at is not None
        assert f.last_token_at is not None
        decode = f.last_token_at - f.first_token_at
        self._e2e.observe(f.at - f.arrival)
        self._queue.observe(f.scheduled_at - f.arrival)
        self._prefill.observe(f.first_token_at - f.scheduled_at)
        self._inference.observe(f.last_token_at - f.scheduled_at)
        self._decode.observe(decode)
        self._preemptions.observe(f.num_preemptions)
        self._prefill_kv_computed.observe(f.num_prompt_tokens - f.num_cached_tokens)
        self._prompt_tokens.observe(f.num_prompt_tokens)
        self._generation_tokens.observe(f.num_output_tokens)
        self._tpot.observe(decode / (f.num_output_tokens - 1) if f.num_output_tokens > 1 else 0.0)

    def collect(self) -> Iterator[Metric]:
        for histogram in self._all:
            yield histogram.family(self._labels, self._created)
