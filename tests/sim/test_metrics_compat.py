"""The simulator's /metrics against a real vLLM 0.32 page, parsed with the same parser."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.server import SimConfig, create_app
from tests.sim.conftest import SimFactory

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "vllm" / "metrics-cpu-0.32.txt"

# Every sample the gateway reads from an engine.
READ_BY_GATEWAY = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:cache_config_info",
)
# Also exported (issue 2), checked the same way.
ALSO_EXPORTED = (
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_cached_total",
    "vllm:admission_rejections_total",  # model_name and reason, no engine label
)


def _label_names(page: str) -> dict[str, tuple[str, set[str]]]:
    """sample name -> (family type, label names of its samples)."""
    out: dict[str, tuple[str, set[str]]] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            _, names = out.setdefault(sample.name, (family.type, set()))
            names.update(sample.labels)
    return out


async def test_metric_names_types_and_labels_match_real_vllm(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    real = _label_names(FIXTURE.read_text())
    async with sim() as url:
        await client.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        ours = _label_names((await client.get(f"{url}/metrics")).text)
    for name in READ_BY_GATEWAY + ALSO_EXPORTED:
        assert name in real, name
        assert name in ours, name
        assert ours[name][0] == real[name][0], name  # same type
        if name == "vllm:cache_config_info":
            # vLLM has ~35 cache settings as labels; we export a subset with the same names.
            assert {"block_size", "num_gpu_blocks", "engine"} <= ours[name][1]
            assert ours[name][1] <= real[name][1]
        else:
            assert ours[name][1] == real[name][1], name


async def test_cache_config_info_reports_the_geometry(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(num_gpu_blocks=6, block_size=128, max_model_len=512) as url:
        page = (await client.get(f"{url}/metrics")).text
    (family,) = (
        f for f in text_string_to_metric_families(page) if f.name == "vllm:cache_config_info"
    )
    (sample,) = family.samples
    assert sample.value == 1.0
    assert sample.labels["block_size"] == "128"
    assert sample.labels["num_gpu_blocks"] == "6"
    assert sample.labels["enable_prefix_caching"] == "True"  # vLLM v1's default, as captured
    # As in the real 6-block capture: 768 tokens, 1.5x concurrency at 512 tokens.
    assert sample.labels["kv_cache_size_tokens"] == "768"
    assert sample.labels["kv_cache_max_concurrency"] == "1.5"


async def test_cache_config_info_reports_prefix_caching_off(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(enable_prefix_caching=False) as url:
        page = (await client.get(f"{url}/metrics")).text
    (family,) = (
        f for f in text_string_to_metric_families(page) if f.name == "vllm:cache_config_info"
    )
    assert family.samples[0].labels["enable_prefix_caching"] == "False"


async def test_hidden_metrics_are_left_out_of_the_page(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    hidden = ("vllm:num_preemptions_total", "vllm:cache_config_info", "vllm:prefix_cache_hits")
    async with sim() as url:
        full = _label_names((await client.get(f"{url}/metrics")).text)
    async with sim(hidden_metrics=hidden) as url:
        page = (await client.get(f"{url}/metrics")).text
    ours = _label_names(page)
    gone = {
        "vllm:num_preemptions_total",
        "vllm:num_preemptions_created",
        "vllm:cache_config_info",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_hits_created",
    }
    assert gone <= set(full) and not gone & set(ours)
    assert set(ours) == set(full) - gone
    assert "# HELP vllm:num_preemptions" not in page


def test_hiding_a_metric_the_simulator_does_not_export_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot hide vllm:gpu_cache_usage_perc"):
        create_app(SimConfig(hidden_metrics=("vllm:gpu_cache_usage_perc",)))
