"""What a vLLM engine tells about itself, and the limits the gateway settles on for it.

`discover()` is the I/O edge: it asks one engine for `/v1/models` and `/metrics`.
`resolve_engine_limits()` is a pure decision: configured values win over discovered ones, and
`max_num_seqs`, which vLLM does not expose, falls back to vLLM's own default for the platform.
Every resolved value carries its source so start-up can log it and an admin endpoint can show it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import httpx

from gateway.engines.metrics import CacheConfig, MetricsParseError, parse_page

SOURCE_CONFIG = "config"
SOURCE_MODELS = "discovered:/v1/models"
SOURCE_METRICS = "discovered:/metrics"

# The values `resolve_engine_limits` settles; configuration may set any of them.
LIMIT_KEYS = ("max_model_len", "num_gpu_blocks", "block_size", "max_num_seqs", "dp_size")
# Configuration may also give max_num_batched_tokens: vLLM clamps its max_num_seqs default to it.
_CONFIG_KEYS = frozenset((*LIMIT_KEYS, "max_num_batched_tokens"))


class DiscoveryError(Exception):
    """Discovery of an engine failed, or its limits cannot be settled.

    `url` is the URL that failed (None when no engine was asked); `reason` says what failed.
    """

    def __init__(self, url: str | None, reason: str) -> None:
        self.url = url
        self.reason = reason
        super().__init__(f"{url}: {reason}" if url else reason)


@dataclass(frozen=True)
class DiscoveredModel:
    """One entry of `/v1/models`; `max_model_len` is None when the engine does not report it."""

    id: str
    max_model_len: int | None


@dataclass(frozen=True)
class DiscoveredEngine:
    """What one engine reported. `sources` maps each value that was found to where it came from.

    `num_gpu_blocks` is as vLLM reports it, i.e. summed over the `dp_size` data-parallel ranks;
    `max_model_len` is the smallest one reported over `models` (they share one KV cache).
    """

    base_url: str
    models: tuple[DiscoveredModel, ...]
    max_model_len: int | None
    block_size: int | None
    num_gpu_blocks: int | None
    dp_size: int | None
    cache: CacheConfig | None
    sources: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def model_ids(self) -> tuple[str, ...]:
        return tuple(m.id for m in self.models)


async def discover(client: httpx.AsyncClient, base_url: str) -> DiscoveredEngine:
    """Ask the engine at `base_url` for its models and KV cache geometry.

    Raises `DiscoveryError` naming the URL when a request fails, answers non-2xx, or the body is
    not what vLLM sends. A `/metrics` page without `vllm:cache_config_info` is not an error: the
    geometry is then None and must come from configuration.
    """
    base = base_url.rstrip("/")
    models = _models(await _get_json(client, f"{base}/v1/models"), f"{base}/v1/models")
    cache = await _cache(client, f"{base}/metrics")
    lens = [m.max_model_len for m in models if m.max_model_len is not None]
    sources = {"models": SOURCE_MODELS}
    if lens:
        sources["max_model_len"] = SOURCE_MODELS
    if cache is not None:
        sources.update(dict.fromkeys(("num_gpu_blocks", "block_size", "dp_size"), SOURCE_METRICS))
        if cache.enable_prefix_caching is not None:
            sources["prefix_caching"] = SOURCE_METRICS
    return DiscoveredEngine(
        base_url=base,
        models=models,
        max_model_len=min(lens) if lens else None,
        block_size=cache.block_size if cache else None,
        num_gpu_blocks=cache.num_gpu_blocks if cache else None,
        dp_size=cache.dp_size if cache else None,
        cache=cache,
        sources=MappingProxyType(sources),
    )


async def _get(client: httpx.AsyncClient, url: str) -> httpx.Response:
    try:
        response = await client.get(url)
    except httpx.HTTPError as exc:
        raise DiscoveryError(url, f"request failed: {type(exc).__name__}: {exc}") from exc
    if not response.is_success:
        raise DiscoveryError(url, f"HTTP {response.status_code}: {response.text[:200]!r}")
    return response


async def _get_json(client: httpx.AsyncClient, url: str) -> Any:
    response = await _get(client, url)
    try:
        return response.json()
    except ValueError as exc:
        raise DiscoveryError(url, f"body is not JSON: {exc}") from exc


async def _cache(client: httpx.AsyncClient, url: str) -> CacheConfig | None:
    response = await _get(client, url)
    try:
        return parse_page(response.text).cache
    except MetricsParseError as exc:
        raise DiscoveryError(url, f"unreadable metrics page: {exc}") from exc


def _models(body: Any, url: str) -> tuple[DiscoveredModel, ...]:
    """The entries of a vLLM `/v1/models` body: `{"object": "list", "data": [{"id": ...}]}`."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise DiscoveryError(url, "body has no `data` list of models")
    models = []
    for entry in data:
        model_id = entry.get("id") if isinstance(entry, dict) else None
        if not isinstance(model_id, str) or not model_id:
            raise DiscoveryError(url, f"model entry without a string `id`: {entry!r}")
        max_len = entry.get("max_model_len")
        if max_len is not None and not _is_positive_int(max_len):
            raise DiscoveryError(url, f"model {model_id!r}: bad max_model_len {max_len!r}")
        models.append(DiscoveredModel(id=model_id, max_model_len=max_len))
    if not models:
        raise DiscoveryError(url, "the engine serves no model")
    return tuple(models)


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# max_num_seqs defaults of vLLM's OpenAI API server (UsageContext.OPENAI_API_SERVER), from
# EngineArgs._set_default_args in vllm/engine/arg_utils.py: 1024 when the device has at least
# 70 GiB and is not an A100, else 256; on the CPU backend 128 × world_size (= pipeline × tensor
# parallel size). vLLM then clamps the default to max_num_batched_tokens.
_GPU_DEFAULTS = {
    "gpu": (256, "vLLM OpenAI-server default for GPUs under 70 GiB or A100"),
    "gpu-large": (1024, "vLLM OpenAI-server default for GPUs of 70 GiB or more, not A100"),
}
_CPU_SEQS_PER_WORKER = 128
PLATFORMS = ("gpu", "gpu-large", "cpu", "cpu:<world_size>")


def default_max_num_seqs(
    platform: str, max_num_batched_tokens: int | None = None
) -> tuple[int, str]:
    """vLLM's default `max_num_seqs` per data-parallel rank for `platform`, and why.

    `platform` is one of `PLATFORMS`; `cpu:N` is the CPU backend with tensor × pipeline
    parallel size N (`cpu` = `cpu:1`).
    """
    if platform in _GPU_DEFAULTS:
        seqs, why = _GPU_DEFAULTS[platform]
    elif platform == "cpu" or platform.startswith("cpu:"):
        size = platform.partition(":")[2] or "1"
        if not size.isdigit() or int(size) < 1:
            raise DiscoveryError(
                None, f"platform {platform!r}: world size must be a positive integer"
            )
        seqs = _CPU_SEQS_PER_WORKER * int(size)
        why = f"vLLM OpenAI-server default for the CPU backend, 128 × world size {size}"
    else:
        raise DiscoveryError(None, f"unknown platform {platform!r}; expected one of {PLATFORMS}")
    if max_num_batched_tokens is not None and max_num_batched_tokens < seqs:
        return max_num_batched_tokens, f"{why}, clamped to max_num_batched_tokens"
    return seqs, why


def resolve_engine_limits(
    configured: Mapping[str, int | None],
    discovered: DiscoveredEngine | None,
    platform: str,
) -> tuple[dict[str, int], dict[str, str]]:
    """Settle every key of `LIMIT_KEYS` and say where each value came from.

    Precedence: a configured (non-None) value, else the discovered one, else a default —
    `max_num_seqs` from `default_max_num_seqs(platform, ...)`, `dp_size` 1. Sources are
    "config", "discovered:/v1/models", "discovered:/metrics" or "default:<why>".
    `configured` may also hold `max_num_batched_tokens`, only to clamp the max_num_seqs default
    as vLLM does. Raises `DiscoveryError` for an unknown or non-positive configured value, an
    unknown platform, or a value that is neither configured nor discovered.
    """
    url = discovered.base_url if discovered else None
    unknown = sorted(set(configured) - _CONFIG_KEYS)
    if unknown:
        raise DiscoveryError(
            url, f"unknown engine settings {unknown}; known: {sorted(_CONFIG_KEYS)}"
        )
    for key, value in configured.items():
        if value is not None and not _is_positive_int(value):
            raise DiscoveryError(url, f"configured {key}={value!r} is not a positive integer")

    # Computed even when max_num_seqs is configured, so a mistyped platform fails at start-up.
    try:
        default_seqs, why = default_max_num_seqs(platform, configured.get("max_num_batched_tokens"))
    except DiscoveryError as exc:
        raise DiscoveryError(url, exc.reason) from None
    values: dict[str, int] = {}
    sources: dict[str, str] = {}
    for key in LIMIT_KEYS:
        value = configured.get(key)
        found = getattr(discovered, key) if discovered and key != "max_num_seqs" else None
        if value is not None:
            values[key], sources[key] = value, SOURCE_CONFIG
        elif found is not None:
            assert discovered is not None
            values[key], sources[key] = found, discovered.sources[key]
        elif key == "max_num_seqs":
            values[key], sources[key] = default_seqs, f"default:{why}"
        elif key == "dp_size":
            values[key], sources[key] = 1, "default:no data-parallel ranks reported"
        else:
            where = "the engine does not report it" if discovered else "no engine was discovered"
            raise DiscoveryError(url, f"{key} is not configured and {where}")
    return values, sources


PREFIX_CACHING_UNKNOWN = (
    "default:unknown, counted as off (no enable_prefix_caching in vllm:cache_config_info)"
)


def resolve_prefix_caching(
    configured: bool | None, discovered: DiscoveredEngine | None
) -> tuple[bool, str]:
    """Whether the engine shares cached prompt blocks, and where that came from: configured,
    else what its `/metrics` says, else off (an over-credit costs preemptions, an
    under-credit only throughput)."""
    if configured is not None:
        return configured, SOURCE_CONFIG
    found = discovered.cache.enable_prefix_caching if discovered and discovered.cache else None
    if found is not None:
        return found, SOURCE_METRICS
    return False, PREFIX_CACHING_UNKNOWN
