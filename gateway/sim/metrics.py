"""vLLM's ``/metrics`` for a simulated engine, with ``prometheus_client`` on its own registry.

Names, types and labels follow a real vLLM 0.32 page (``tests/fixtures/vllm/metrics-cpu-0.32.txt``):
per-engine series carry ``engine`` and ``model_name``; ``vllm:cache_config_info`` carries the
cache settings as labels and ``engine`` only. Gauges and counters are read from the engine's
snapshot at scrape time, so they can never drift from the scheduler's state; vLLM's latency
and size histograms (``gateway.sim.histograms``) are observed by the step loop after every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.sim.engine import EngineLimits, EngineSnapshot, StepOutcome
from gateway.sim.front_door import REFUSAL_REASONS, RefusalReason
from gateway.sim.histograms import EngineHistograms

# Every finished_reason label vLLM 0.32 exports, zeros included.
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")

ENGINE_INDEX = "0"


class EngineMetrics:
    """The registry of one simulated engine; ``render()`` is the /metrics body.

    ``hidden`` names metric families left out of ``render()`` (a testing aid: a page like an
    older vLLM's, or another engine's). A name is a family's (``vllm:num_preemptions``) or one
    of its sample names (``vllm:num_preemptions_total``); a name this simulator does not
    export raises ``ValueError``, so a typo cannot silently hide nothing.
    """

    def __init__(
        self,
        *,
        model_name: str,
        limits: EngineLimits,
        snapshot: Callable[[], EngineSnapshot],
        started_at: float,
        gpu_memory_utilization: float = 0.92,
        hidden: Iterable[str] = (),
    ) -> None:
        self.registry = CollectorRegistry()
        self._labels = {"engine": ENGINE_INDEX, "model_name": model_name}
        self.registry.register(
            _EngineCollector(
                self._labels,
                _cache_config_labels(limits, gpu_memory_utilization),
                snapshot,
                started_at,
            )
        )
        self._histograms = EngineHistograms(
            self._labels, max_model_len=limits.max_model_len, created=started_at
        )
        self.registry.register(self._histograms)
        # A front-door counter: vLLM labels it by model and reason, without ``engine``.
        rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            labelnames=("model_name", "reason"),
            registry=self.registry,
        )
        self._rejections = {
            reason: rejections.labels(model_name=model_name, reason=reason)
            for reason in REFUSAL_REASONS
        }
        # /metrics is rendered from a view that leaves the hidden families out.
        self._page = CollectorRegistry(auto_describe=False)
        self._page.register(_Hiding(self.registry, frozenset(hidden)))

    def observe_step(self, outcome: StepOutcome) -> None:
        """Feed one step's tokens and finished requests to vLLM's histograms."""
        self._histograms.observe_step(outcome)

    def count_admission_rejection(self, reason: RefusalReason) -> None:
        self._rejections[reason].inc()

    def render(self) -> bytes:
        return generate_latest(self._page)


class _Hiding(Collector):
    """The families of ``registry`` but those named in ``hidden``."""

    def __init__(self, registry: CollectorRegistry, hidden: frozenset[str]) -> None:
        self._registry = registry
        families = {f.name: {s.name for s in f.samples} for f in registry.collect()}
        unknown = hidden - {name for f, samples in families.items() for name in {f, *samples}}
        if unknown:
            raise ValueError(
                f"cannot hide {', '.join(sorted(unknown))}: not a metric of this simulator "
                f"(it exports {', '.join(sorted(families))})"
            )
        self._hidden = {f for f, samples in families.items() if hidden & {f, *samples}}

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            if family.name not in self._hidden:
                yield family


def _cache_config_labels(limits: EngineLimits, gpu_memory_utilization: float) -> dict[str, str]:
    tokens = limits.num_gpu_blocks * limits.block_size
    per_request = math.ceil(limits.max_model_len / limits.block_size)
    return {
        "block_size": str(limits.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(limits.enable_prefix_caching),
        "engine": ENGINE_INDEX,
        "gpu_memory_utilization": str(gpu_memory_utilization),
        "kv_cache_max_concurrency": str(limits.num_gpu_blocks / per_request),
        "kv_cache_size_tokens": str(tokens),
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(limits.num_gpu_blocks),
        "num_gpu_blocks_override": str(limits.num_gpu_blocks),
        "sliding_window": "None",
    }


class _EngineCollector(Collector):
    def __init__(
        self,
        labels: dict[str, str],
        cache_config: dict[str, str],
        snapshot: Callable[[], EngineSnapshot],
        created: float,
    ) -> None:
        self._names = list(labels)
        self._values = list(labels.values())
        self._cache_config = cache_config
        self._snapshot = snapshot
        self._created = created

    def collect(self) -> Iterator[Metric]:
        # As prometheus_client's process collector on vLLM's page: a restart changes it.
        yield GaugeMetricFamily(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            value=self._created,
        )
        snap = self._snapshot()
        yield self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            snap.running,
        )
        yield self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            snap.waiting,
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            snap.kv_cache_usage,
        )
        yield self._counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            snap.num_preemptions,
        )
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            snap.prefix_cache_queries,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            snap.prefix_cache_hits,
        )
        yield self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", snap.prompt_tokens
        )
        yield self._counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            snap.prompt_tokens_cached,
        )
        yield self._counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            snap.generation_tokens,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*self._names, "finished_reason"],
        )
        for reason in FINISHED_REASONS:
            success.add_metric(
                [*self._values, reason], snap.finished.get(reason, 0), created=self._created
            )
        yield success
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(self._cache_config),
        )
        info.add_metric(list(self._cache_config.values()), 1.0)
        yield info

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, documentation, labels=self._names)
        family.add_metric(self._values, value)
        return family

    def _counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, documentation, labels=self._names)
        family.add_metric(self._values, value, created=self._created)
        return family
