"""`resolve_engine_limits`: configured > discovered > vLLM's default, each value with its source."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType

import pytest

from gateway.engines.discovery import (
    LIMIT_KEYS,
    PREFIX_CACHING_UNKNOWN,
    DiscoveredEngine,
    DiscoveredModel,
    DiscoveryError,
    default_max_num_seqs,
    resolve_engine_limits,
    resolve_prefix_caching,
)
from gateway.engines.metrics import CacheConfig

MODELS = "discovered:/v1/models"
METRICS = "discovered:/metrics"
GPU_DEFAULT = "default:vLLM OpenAI-server default for GPUs under 70 GiB or A100"
CPU_DEFAULT = "default:vLLM OpenAI-server default for the CPU backend, 128 × world size 1"


def engine(
    max_model_len: int | None = 512, num_gpu_blocks: int | None = 8192, dp_size: int = 1
) -> DiscoveredEngine:
    sources = {"models": MODELS}
    if max_model_len is not None:
        sources["max_model_len"] = MODELS
    if num_gpu_blocks is not None:
        sources.update(num_gpu_blocks=METRICS, block_size=METRICS, dp_size=METRICS)
    return DiscoveredEngine(
        base_url="http://engine-a:8000",
        models=(DiscoveredModel("tiny", max_model_len),),
        max_model_len=max_model_len,
        block_size=128 if num_gpu_blocks is not None else None,
        num_gpu_blocks=num_gpu_blocks,
        dp_size=dp_size if num_gpu_blocks is not None else None,
        cache=None,
        sources=MappingProxyType(sources),
    )


@dataclass(frozen=True)
class Case:
    name: str
    configured: dict[str, int | None]
    discovered: DiscoveredEngine | None
    platform: str
    values: dict[str, int]
    sources: dict[str, str] = field(default_factory=dict)


DISCOVERED_ALL = {
    "max_model_len": MODELS,
    "num_gpu_blocks": METRICS,
    "block_size": METRICS,
    "dp_size": METRICS,
}
CASES = [
    Case(
        "urls only: everything discovered, max_num_seqs from the GPU default",
        {},
        engine(),
        "gpu",
        {"max_model_len": 512, "num_gpu_blocks": 8192, "block_size": 128, "max_num_seqs": 256},
        {**DISCOVERED_ALL, "max_num_seqs": GPU_DEFAULT},
    ),
    Case(
        "None in the config means not configured",
        {"num_gpu_blocks": None, "max_num_seqs": None},
        engine(),
        "gpu",
        {"num_gpu_blocks": 8192, "max_num_seqs": 256},
        {"num_gpu_blocks": METRICS, "max_num_seqs": GPU_DEFAULT},
    ),
    Case(
        "configured values override discovered ones",
        {"num_gpu_blocks": 4000, "max_model_len": 256, "max_num_seqs": 8},
        engine(),
        "gpu",
        {"num_gpu_blocks": 4000, "max_model_len": 256, "max_num_seqs": 8, "block_size": 128},
        {
            "num_gpu_blocks": "config",
            "max_model_len": "config",
            "max_num_seqs": "config",
            "block_size": METRICS,
        },
    ),
    Case(
        "no discovery: all from config, dp_size defaults to 1",
        {"max_model_len": 4096, "num_gpu_blocks": 17236, "block_size": 16, "max_num_seqs": 64},
        None,
        "gpu",
        {"max_model_len": 4096, "num_gpu_blocks": 17236, "block_size": 16, "max_num_seqs": 64},
        {"max_model_len": "config", "dp_size": "default:no data-parallel ranks reported"},
    ),
    Case(
        "max_model_len missing from /v1/models but configured",
        {"max_model_len": 1024},
        engine(max_model_len=None),
        "gpu",
        {"max_model_len": 1024, "num_gpu_blocks": 8192},
        {"max_model_len": "config", "num_gpu_blocks": METRICS},
    ),
    Case(
        "large GPU default",
        {},
        engine(),
        "gpu-large",
        {"max_num_seqs": 1024},
        {"max_num_seqs": "default:vLLM OpenAI-server default for GPUs of 70 GiB or more, not A100"},
    ),
    Case(
        "CPU default",
        {},
        engine(),
        "cpu",
        {"max_num_seqs": 128},
        {"max_num_seqs": CPU_DEFAULT},
    ),
    Case("CPU, tensor × pipeline parallel size 4", {}, engine(), "cpu:4", {"max_num_seqs": 512}),
    Case(
        "default clamped to max_num_batched_tokens, as vLLM does",
        {"max_num_batched_tokens": 100},
        engine(),
        "gpu",
        {"max_num_seqs": 100},
        {"max_num_seqs": GPU_DEFAULT + ", clamped to max_num_batched_tokens"},
    ),
    Case(
        "data-parallel engine: summed blocks and dp_size as discovered",
        {},
        engine(num_gpu_blocks=16384, dp_size=2),
        "gpu",
        {"num_gpu_blocks": 16384, "dp_size": 2},
        {"num_gpu_blocks": METRICS, "dp_size": METRICS},
    ),
    Case(
        "configured dp_size overrides",
        {"dp_size": 4},
        engine(num_gpu_blocks=16384, dp_size=2),
        "gpu",
        {"dp_size": 4},
        {"dp_size": "config"},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_precedence(case: Case) -> None:
    values, sources = resolve_engine_limits(case.configured, case.discovered, case.platform)
    assert set(values) == set(sources) == set(LIMIT_KEYS)
    assert {k: values[k] for k in case.values} == case.values
    assert {k: sources[k] for k in case.sources} == case.sources


@pytest.mark.parametrize(
    ("configured", "discovered", "platform", "message"),
    [
        ({}, None, "gpu", "max_model_len is not configured and no engine was discovered"),
        ({}, engine(max_model_len=None), "gpu", "max_model_len is not configured and the engine"),
        ({"max_model_len": 512}, engine(num_gpu_blocks=None), "gpu", "num_gpu_blocks is not"),
        ({"max_num_seq": 8}, engine(), "gpu", r"unknown engine settings \['max_num_seq'\]"),
        ({"max_num_seqs": 0}, engine(), "gpu", "max_num_seqs=0 is not a positive integer"),
        ({"block_size": True}, engine(), "gpu", "block_size=True is not a positive integer"),
        ({"max_num_seqs": 8}, engine(), "h100", "unknown platform 'h100'"),
        ({}, engine(), "cpu:zero", "world size must be a positive integer"),
    ],
)
def test_errors(
    configured: dict[str, int | None],
    discovered: DiscoveredEngine | None,
    platform: str,
    message: str,
) -> None:
    with pytest.raises(DiscoveryError, match=message):
        resolve_engine_limits(configured, discovered, platform)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_error_names_the_engine(platform: str) -> None:
    with pytest.raises(DiscoveryError) as caught:
        resolve_engine_limits({}, engine(max_model_len=None), platform)
    assert caught.value.url == "http://engine-a:8000"
    assert str(caught.value).startswith("http://engine-a:8000: ")


@pytest.mark.parametrize(
    ("platform", "batched", "seqs"),
    [
        ("gpu", None, 256),
        ("gpu-large", None, 1024),
        ("cpu", None, 128),
        ("cpu:2", None, 256),
        ("gpu-large", 8192, 1024),
        ("gpu-large", 512, 512),
        ("cpu", 64, 64),
    ],
)
def test_default_max_num_seqs(platform: str, batched: int | None, seqs: int) -> None:
    assert default_max_num_seqs(platform, batched)[0] == seqs


@pytest.mark.parametrize(
    ("configured", "label", "expected"),
    [
        (None, True, (True, "discovered:/metrics")),
        (None, False, (False, "discovered:/metrics")),
        (None, None, (False, PREFIX_CACHING_UNKNOWN)),  # unknown counts as off
        (False, True, (False, "config")),
        (True, None, (True, "config")),
    ],
)
def test_prefix_caching_is_configured_else_read_from_the_page_else_off(
    configured: bool | None, label: bool | None, expected: tuple[bool, str]
) -> None:
    cache = CacheConfig(block_size=16, num_gpu_blocks=100, enable_prefix_caching=label)
    found = replace(engine(), cache=cache)
    assert resolve_prefix_caching(configured, found) == expected
    assert resolve_prefix_caching(configured, None)[0] is (configured is True)
