"""--max-num-queued-reqs / --max-num-queued-tokens over HTTP: 503, vLLM's body, the metric."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from tests.sim.conftest import SimFactory, metrics, state, wait_idle

BUSY = {
    "error": {
        "message": "The engine is currently busy and cannot accept new requests. Please try "
        "again later or on a different instance.",
        "type": "Service Unavailable",
        "param": None,
        "code": 503,
    }
}
BACKLOG = {
    "error": {
        "message": "The engine has reached its prefill token backlog limit. Please try again "
        "later or on a different instance.",
        "type": "Service Unavailable",
        "param": None,
        "code": 503,
    }
}


def _body(prompt_len: int = 6, max_tokens: int = 30, **extra: Any) -> dict[str, Any]:
    prompt = list(range(100, 100 + prompt_len))
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


async def _until(client: httpx.AsyncClient, url: str, running: int, waiting: int) -> None:
    async with asyncio.timeout(5):
        while True:
            st = await state(client, url)
            if (st["running"], st["waiting"]) == (running, waiting):
                return
            await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def _in_flight(
    client: httpx.AsyncClient, url: str, *bodies: dict[str, Any]
) -> AsyncIterator[list[asyncio.Task[httpx.Response]]]:
    tasks = [asyncio.create_task(client.post(f"{url}/v1/completions", json=b)) for b in bodies]
    try:
        yield tasks
    finally:
        await asyncio.gather(*tasks, return_exceptions=True)


async def _rejections(client: httpx.AsyncClient, url: str) -> tuple[float, float]:
    m = await metrics(client, url)
    return (
        m["vllm:admission_rejections_total{reason=max_num_queued_reqs}"],
        m["vllm:admission_rejections_total{reason=max_num_queued_tokens}"],
    )


async def test_max_num_queued_reqs_refuses_with_503(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(max_num_queued_reqs=2, max_num_seqs=1, decode_ms_base=20) as url:
        assert await _rejections(client, url) == (0, 0)
        async with _in_flight(client, url, _body(), _body()) as tasks:
            await _until(client, url, running=1, waiting=1)
            refused = await client.post(f"{url}/v1/completions", json=_body())
            assert refused.status_code == 503 and refused.json() == BUSY
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            refused = await client.post(f"{url}/v1/chat/completions", json=chat)
            assert refused.status_code == 503 and refused.json() == BUSY
            assert [r.status_code for r in await asyncio.gather(*tasks)] == [200, 200]
        assert await _rejections(client, url) == (2, 0)
        # n sequences count n: 3 never fit under a limit of 2, even on an idle engine.
        await wait_idle(client, url)
        refused = await client.post(f"{url}/v1/completions", json=_body(n=3))
        assert refused.status_code == 503
        assert (await client.post(f"{url}/v1/completions", json=_body(n=2))).status_code == 200
        assert await _rejections(client, url) == (3, 0)


async def test_max_num_queued_tokens_refuses_while_prompts_wait_for_prefill(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(max_num_queued_tokens=20, max_num_seqs=1, decode_ms_base=20) as url:
        # One request decoding (no longer in prefill), one 30-token prompt waiting behind it.
        async with _in_flight(client, url, _body(6), _body(30)) as tasks:
            await _until(client, url, running=1, waiting=1)
            refused = await client.post(f"{url}/v1/completions", json=_body(2, max_tokens=2))
            assert refused.status_code == 503 and refused.json() == BACKLOG
            assert [r.status_code for r in await asyncio.gather(*tasks)] == [200, 200]
        assert await _rejections(client, url) == (0, 1)
        # The backlog is what waits, not the new prompt: a 40-token prompt alone is accepted.
        assert (await client.post(f"{url}/v1/completions", json=_body(40))).status_code == 200


async def test_without_the_flags_nothing_is_refused(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(max_num_seqs=1, decode_ms_base=5) as url:
        replies = await asyncio.gather(
            *(client.post(f"{url}/v1/completions", json=_body(30)) for _ in range(8))
        )
        assert {r.status_code for r in replies} == {200}
        assert await _rejections(client, url) == (0, 0)
