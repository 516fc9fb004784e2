"""The engines' prefix-cache counters in the scraped metrics: parsed from a page, and a
run's hit rate from a real simulated engine over HTTP."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.harness import SimProcess
from gateway.loadtest.scrape import Scraper, prefix_cache_counters

PAGE = """\
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 300.0
vllm:prefix_cache_queries_total{engine="1",model_name="tiny"} 100.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 96.0
vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 32.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
"""


@pytest.mark.parametrize(
    ("page", "expected"),
    [
        (PAGE, {"prefix_queries": 400.0, "prefix_hits": 128.0}),  # ranks summed
        (
            PAGE.split("# TYPE vllm:prefix_cache_hits")[0],
            {"prefix_queries": 400.0, "prefix_hits": 0.0},
        ),
        ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1.0\n", {}),
        ("not a page {{{", {}),
    ],
)
def test_prefix_cache_counters(page: str, expected: dict[str, float]) -> None:
    assert prefix_cache_counters(page) == expected


def test_a_repeated_prompt_counts_as_hits(sim: SimProcess) -> None:
    """Two equal prompts of 64 tokens (blocks of 16): the second hits its first three blocks
    (vLLM computes the last prompt token in any case), 48 of 128 queried tokens."""

    async def scenario() -> dict[str, object]:
        scraper = Scraper((sim.url,), None)
        body = {"model": "tiny", "prompt": list(range(1000, 1064)), "max_tokens": 1}
        async with httpx.AsyncClient(timeout=10) as http:
            await scraper.scrape_once(http)
            for _ in range(2):
                answer = await http.post(sim.url + "/v1/completions", json=body)
                assert answer.status_code == 200
            await scraper.scrape_once(http)
        return scraper.summary()

    summary = asyncio.run(scenario())
    assert summary["prefix_cache_queries"] == 128
    assert summary["prefix_cache_hits"] == 48
    assert summary["prefix_cache_hit_rate"] == pytest.approx(48 / 128, abs=1e-4)


def test_no_prefix_counters_no_hit_rate() -> None:
    scraper = Scraper(("http://engine",), None)
    scraper.engine_series["http://engine"] = [
        {"t": 0.0, "running": 0, "waiting": 0, "kv_usage": 0.0, "preemptions": 0},
        {"t": 1.0, "running": 1, "waiting": 0, "kv_usage": 0.1, "preemptions": 0},
    ]
    summary = scraper.summary()
    assert "prefix_cache_hit_rate" not in summary and summary["preemptions"] == 0
