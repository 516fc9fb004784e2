"""Automatic prefix caching seen over real HTTP: hits, sharing, LRU eviction, the flags."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai

from tests.sim.conftest import SimFactory, metrics, state, wait_idle

# 8 usable blocks of 4 tokens: small enough to reason about every block.
SMALL = dict(num_gpu_blocks=9, block_size=4, max_model_len=32)


def _prompt(first: int, length: int = 9) -> list[int]:
    return list(range(first, first + length))


async def _complete(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int = 1, **extra: Any
) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    reply = await client.post(f"{url}/v1/completions", json={**body, **extra})
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def _cached(answer: dict[str, Any]) -> int:
    details = answer["usage"]["prompt_tokens_details"]
    return 0 if details is None else int(details["cached_tokens"])


async def test_a_repeated_prompt_hits_and_the_metrics_count_it(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(**SMALL, enable_prompt_tokens_details=True) as url:
        prompt = _prompt(100, 10)  # 2 full blocks + 2 tokens
        first = await _complete(client, url, prompt)
        m = await metrics(client, url)
        assert (m["vllm:prefix_cache_queries_total"], m["vllm:prefix_cache_hits_total"]) == (10, 0)
        assert first["usage"]["prompt_tokens_details"] is None  # nothing cached: vLLM omits it
        second = await _complete(client, url, prompt)
        assert _cached(second) == 8 and second["usage"]["prompt_tokens"] == 10
        m = await metrics(client, url)
        assert (m["vllm:prefix_cache_queries_total"], m["vllm:prefix_cache_hits_total"]) == (20, 8)
        assert m["vllm:prompt_tokens_cached_total"] == 8
        assert m["vllm:prompt_tokens_total"] == 20  # cached tokens are prompt tokens too
        idle = await wait_idle(client, url)
        # Idle: nothing referenced, the cached blocks still there and counted as free.
        assert idle["used_blocks"] == 0 and idle["cached_blocks"] == 2
        assert idle["evictable_blocks"] == 2 and idle["kv_cache_usage"] == 0.0


async def test_cached_tokens_are_reported_only_with_the_flag(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(**SMALL) as url:
        prompt = _prompt(100)
        await _complete(client, url, prompt)
        again = await _complete(client, url, prompt)
        assert again["usage"]["prompt_tokens_details"] is None
        assert (await metrics(client, url))["vllm:prefix_cache_hits_total"] == 8


async def test_chat_and_streams_report_cached_tokens(sim: SimFactory) -> None:
    async with sim(enable_prompt_tokens_details=True, block_size=4) as url:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "the same long question, asked twice " * 3}]
        first = await api.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        assert first.usage is not None and first.usage.prompt_tokens_details is None
        stream = await api.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        async for part in stream:
            usage = part.usage or usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens
        assert cached == (usage.prompt_tokens - 1) // 4 * 4  # every full block but the cap
        await api.close()


async def test_concurrent_requests_with_a_shared_prefix_share_blocks(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(num_gpu_blocks=33, block_size=4, max_model_len=64, decode_ms_base=40) as url:
        shared = _prompt(300, 16)  # 4 full blocks
        bodies = [
            {"model": "tiny", "prompt": [*shared, *tail], "max_tokens": 30, "ignore_eos": True}
            for tail in ([1, 2, 3], [7, 8, 9, 10, 11])
        ]
        tasks = [
            asyncio.create_task(client.post(f"{url}/v1/completions", json=body)) for body in bodies
        ]
        async with asyncio.timeout(5):
            while True:
                st = await state(client, url)
                running = [r for r in st["requests"] if r["status"] == "running"]
                if len(running) == 2:
                    break
                await asyncio.sleep(0.005)
        a, b = running
        assert a["block_ids"][:4] == b["block_ids"][:4]  # the prefix's blocks, shared
        assert st["used_blocks"] == a["num_blocks"] + b["num_blocks"] - 4
        assert sorted([a["num_cached_tokens"], b["num_cached_tokens"]]) == [0, 16]
        assert [r.status_code for r in await asyncio.gather(*tasks)] == [200, 200]
        assert (await wait_idle(client, url))["used_blocks"] == 0


async def test_eviction_takes_the_least_recently_freed_blocks(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    """9-token prompts hold 3 blocks (2 full, cached) while they run; 8 blocks in all."""
    async with sim(**SMALL, enable_prompt_tokens_details=True) as url:
        a, b, d, e = _prompt(100), _prompt(200), _prompt(300), _prompt(400)
        await _complete(client, url, a)  # blocks 1-3; free: 4-8, then a's 3, 2, 1
        await _complete(client, url, b)  # blocks 4-6; free: 7, 8, a's, then b's
        await _complete(client, url, d)  # 7, 8 and a's uncached partial block: no eviction
        assert (await state(client, url))["cached_blocks"] == 6
        await _complete(client, url, e)  # a's two cached blocks are the oldest: evicted
        assert _cached(await _complete(client, url, b)) == 8  # b, freed later, is intact
        assert _cached(await _complete(client, url, a)) == 0


async def test_a_full_cache_evicts_before_anything_is_preempted(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(**SMALL) as url:
        for first in (100, 200, 300, 400):  # 4 prompts of exactly 2 blocks: all 8 cached
            await _complete(client, url, _prompt(first, 8))
        idle = await state(client, url)
        assert idle["evictable_blocks"] == 8 and idle["used_blocks"] == 0
        assert (await metrics(client, url))["vllm:kv_cache_usage_perc"] == 0.0
        await _complete(client, url, _prompt(500, 20), max_tokens=12)  # grows to 8 blocks
        st = await state(client, url)
        assert st["peak_used_blocks"] == 8 and st["num_preemptions"] == 0
        assert (await metrics(client, url))["vllm:num_preemptions_total"] == 0


async def test_without_prefix_caching_nothing_is_shared_or_counted(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(**SMALL, enable_prefix_caching=False, enable_prompt_tokens_details=True) as url:
        prompt = _prompt(100, 10)
        await _complete(client, url, prompt)
        again = await _complete(client, url, prompt)
        assert again["usage"]["prompt_tokens_details"] is None
        m = await metrics(client, url)
        assert m["vllm:prefix_cache_queries_total"] == 0
        assert m["vllm:prefix_cache_hits_total"] == 0
        assert m["vllm:prompt_tokens_cached_total"] == 0
        idle = await state(client, url)
        assert idle["cached_blocks"] == 0 and idle["enable_prefix_caching"] is False
