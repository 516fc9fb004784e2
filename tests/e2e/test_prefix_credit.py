"""Prefix caching through the gateway, on the real engine (issue 15): a prompt repeated while
its first copy runs is reserved with a credit for the blocks vLLM shares, it is admitted where
it would otherwise have waited, and vLLM's block use stays within the gateway's reservations.

The package's engine has 6 blocks of 128 tokens (5 usable, `tests/e2e/gateway_process.py`),
prefix caching on (vLLM v1's default). A prompt of 257-384 tokens fills 2 full blocks and
part of a third; vLLM always computes the last prompt token, so a hit covers 2 blocks.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from gateway.core.footprint import ceil_div
from gateway.tokens import make_counter
from tests.e2e import conftest
from tests.e2e.block_watch import BlockWatch
from tests.e2e.gateway_process import TOKENIZER_DIR, GatewayProcess

pytestmark = pytest.mark.vllm

UNIT = "for block in cache: block.ref_cnt += 1\n"
FIRST_OUT = 190  # the first request's output: it runs while the second is admitted (4 blocks)
SECOND_OUT = 30


async def _prompt() -> tuple[str, int]:
    counter = make_counter(f"hf:{TOKENIZER_DIR}", model="tiny")
    for repeat in range(1, 200):
        tokens = (await counter.count_prompt(UNIT * repeat)).count
        if 2 * conftest.BLOCK_SIZE + 20 <= tokens <= 2 * conftest.BLOCK_SIZE + 60:
            return UNIT * repeat, tokens
    raise AssertionError(f"no repetition of {UNIT!r} has 277..316 tokens")


def _hits(vllm_url: str) -> float:
    """vLLM's prefix cache hits so far, in tokens."""
    text = httpx.get(f"{vllm_url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total")
    )


ATTEMPTS = 3
"""Runs of the pair until the block watcher has seen vLLM's usage at least once: on a busy
2-core machine vLLM's API server answered no `/metrics` for the whole run once (CI, stop 22:
`used=[]`), which says nothing either way about the blocks it held."""


@dataclass
class Pair:
    watch: BlockWatch
    second: Any  # the second answer's raw response
    first_done: bool
    tail: list[str]
    hits: float  # vLLM's prefix-cache hits during the pair, in tokens


async def _pair(vllm_url: str, gateway: GatewayProcess, prompt: str, first_blocks: int) -> Pair:
    """The first request streaming, the same prompt sent beside it, both read to their end."""
    hits_before = _hits(vllm_url)
    async with openai.AsyncOpenAI(
        base_url=f"{gateway.url}/v1", api_key="e2e", max_retries=0, timeout=120
    ) as client:
        with BlockWatch(vllm_url, gateway.url) as watch:
            async with client.completions.with_streaming_response.create(
                model="tiny",
                prompt=prompt,
                max_tokens=FIRST_OUT,
                stream=True,
                extra_body={"ignore_eos": True},
            ) as first:
                assert first.headers["x-kv-gateway-blocks"] == str(first_blocks)
                assert "x-kv-gateway-prefix-credit" not in first.headers
                # Sent at once, while the first's lease surely lives (its answer has 190 tokens
                # to go; waiting for its first token let it end first on a busy machine). vLLM
                # has the first already and schedules it first, so the second finds its blocks.
                lines = first.iter_lines()
                second = await asyncio.wait_for(
                    client.completions.with_raw_response.create(
                        model="tiny",
                        prompt=prompt,
                        max_tokens=SECOND_OUT,
                        extra_body={"ignore_eos": True},
                    ),
                    timeout=60,
                )
                rest = [line async for line in lines if line]
    done = bool(rest) and rest[-1] == "data: [DONE]"
    return Pair(watch, second, done, rest[-3:], _hits(vllm_url) - hits_before)


async def test_a_repeated_prompt_is_credited_and_vllm_stays_within_the_reservations(
    vllm_url: str, gateway: GatewayProcess
) -> None:
    prompt, tokens = await _prompt()
    size = conftest.BLOCK_SIZE
    first_blocks = ceil_div(tokens + FIRST_OUT, size)  # 4
    second_whole = ceil_div(tokens + SECOND_OUT, size)  # 3
    credit = (tokens - 1) // size  # 2
    usable = gateway.status()["engines"][0]["capacity_blocks"]
    # Without the credit the second would not fit beside the first: it would wait.
    assert first_blocks + second_whole > usable >= first_blocks + second_whole - credit
    reserved = first_blocks + second_whole - credit
    for _ in range(ATTEMPTS):
        pair = await _pair(vllm_url, gateway, prompt, first_blocks)
        assert pair.first_done, pair.tail
        # Admitted beside the first, credited with the blocks the first holds.
        second = pair.second
        assert second.headers["x-kv-gateway-prefix-credit"] == str(credit), second.headers
        assert second.headers["x-kv-gateway-blocks"] == str(second_whole - credit)
        answer = second.parse()
        assert answer.usage is not None and answer.usage.prompt_tokens == tokens
        assert answer.usage.completion_tokens == SECOND_OUT
        # vLLM shared them (its hit counter moved by at least the credited tokens).
        assert pair.hits >= credit * size
        watch = pair.watch
        # Reserved: nothing, the first alone, both; or the second alone with the shared
        # blocks it now holds by itself (`second_whole`: the first ended first, seen once).
        assert set(watch.reserved) <= {0, first_blocks, reserved, second_whole}, watch
        if watch.used:
            break
    # vLLM never held more than the gateway reserved for both.
    assert watch.used, f"vLLM's usage was never sampled in {ATTEMPTS} runs: {watch}"
    assert max(watch.used) <= reserved, watch
    conftest.record_figure(
        f"prefix credit for a repeated {tokens}-token prompt",
        f"reserved {first_blocks} + {second_whole - credit} (credit {credit}) of {usable}; "
        f"vLLM peak {max(watch.used)} blocks, hits +{pair.hits:.0f} tokens",
    )
