"""Prefix credit only where the engine caches (issue 37), over real sockets: the simulator
(`gateway.sim`, faithful to vLLM's block pool) with and without `--no-enable-prefix-caching`,
the gateway in `worst_case` in front of it, on the in-process store and on the real Redis.

The issue's reproduction: 16 concurrent identical completions of 300 prompt tokens and
`max_tokens` 60 — 23 blocks of 16 each, two fit on 64 blocks. With caching off the engine
shares nothing, so a credit (18 prompt blocks held by the request beside it) let a third
request in and the engine preempted (12 preemptions before the fix).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gateway.config import parse_config
from gateway.embedded import running_app
from gateway.harness import SimProcess
from gateway.http.app import create_app
from gateway.runtime import build_runtime
from tests.admin import ADMIN_HEADERS, with_admin
from tests.redis_server import redis_url

PROMPT = list(range(1000, 1300))  # 300 token ids: the same prompt every time
MAX_TOKENS = 60
CONCURRENT = 16
SIM = dict(
    num_gpu_blocks=64,
    block_size=16,
    max_num_seqs=16,
    max_model_len=512,
    decode_ms_base=2.0,
    decode_ms_per_seq=0.05,
    prefill_ms_per_token=0.001,
)


@contextlib.asynccontextmanager
async def gateway(engine: SimProcess, store: str, **configured: Any) -> AsyncIterator[str]:
    raw: dict[str, Any] = {
        "engines": [{"name": "e", "url": engine.url, **configured}],
        "models": [{"name": "tiny", "tokenizer": "hf:@tiny"}],
        "health": {"scrape_interval_s": 0.2, "timeout_s": 1.0, "backoff_max_s": 0.5},
        "queue": {"max_length": 32, "max_wait_s": 60},
    }
    if store == "redis":
        raw["redis"] = {"url": redis_url(), "key_prefix": f"t{uuid.uuid4().hex[:10]}"}
    runtime = await build_runtime(parse_config(with_admin(raw)))
    async with running_app(create_app(runtime)) as url:
        yield url


async def engine_status(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    got = await http.get(url + "/admin/status", headers=ADMIN_HEADERS)
    engine: dict[str, Any] = got.json()["engines"][0]
    return engine


async def preemptions(http: httpx.AsyncClient, engine: SimProcess) -> float:
    text = (await http.get(engine.url + "/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_preemptions_total")
    )


async def burst(http: httpx.AsyncClient, url: str) -> list[httpx.Response]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    return list(
        await asyncio.gather(
            *(http.post(url + "/v1/completions", json=body) for _ in range(CONCURRENT))
        )
    )


def credits(answers: list[httpx.Response]) -> list[int]:
    return [int(r.headers.get("x-kv-gateway-prefix-credit", 0)) for r in answers]


@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
@pytest.mark.parametrize("caching", [False, True])
async def test_credit_only_where_the_engine_caches_and_never_a_preemption(
    store: str, caching: bool
) -> None:
    engine = SimProcess(**SIM, enable_prefix_caching=caching)
    await engine.astart()
    try:
        async with gateway(engine, store) as url, httpx.AsyncClient(timeout=120) as http:
            status = await engine_status(http, url)
            assert status["prefix_caching"] is caching
            assert status["sources"]["prefix_caching"] == "discovered:/metrics"
            answers = await burst(http, url)
            assert [r.status_code for r in answers] == [200] * CONCURRENT, answers[0].text
            assert all(r.headers["x-kv-gateway-blocks"] for r in answers)
            if caching:
                # Requests beside one holding the prompt are credited its 18 full blocks.
                assert max(credits(answers)) == (len(PROMPT) - 1) // 16
            else:
                assert credits(answers) == [0] * CONCURRENT
                assert {r.headers["x-kv-gateway-blocks"] for r in answers} == {"23"}
            assert await preemptions(http, engine) == 0
            after = await engine_status(http, url)
            assert (after["reserved_blocks"], after["reserved_seqs"]) == (0, 0)
    finally:
        engine.stop()


@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def test_an_engine_restarted_without_caching_is_no_longer_credited(store: str) -> None:
    engine = SimProcess(**SIM, enable_prefix_caching=True)
    await engine.astart()
    try:
        async with gateway(engine, store) as url, httpx.AsyncClient(timeout=120) as http:
            assert max(credits(await burst(http, url))) > 0  # it caches: credited
            engine.stop()
            await engine.configure(enable_prefix_caching=False).astart()
            for _ in range(200):  # ejected, then readmitted with the new figures
                status = await engine_status(http, url)
                if status["healthy"] and status["prefix_caching"] is False:
                    break
                await asyncio.sleep(0.05)
            assert status["healthy"] and status["prefix_caching"] is False, status
            answers = await burst(http, url)
            assert [r.status_code for r in answers] == [200] * CONCURRENT, answers[0].text
            assert credits(answers) == [0] * CONCURRENT
            assert await preemptions(http, engine) == 0  # the new process's count
    finally:
        engine.stop()


async def test_the_configured_setting_wins_over_what_the_engine_says() -> None:
    engine = SimProcess(**SIM, enable_prefix_caching=True)
    await engine.astart()
    try:
        async with (
            gateway(engine, "memory", prefix_caching=False) as url,
            httpx.AsyncClient(timeout=120) as http,
        ):
            await asyncio.sleep(0.5)  # a few scrapes of a page that says it caches
            status = await engine_status(http, url)
            assert status["prefix_caching"] is False
            assert status["sources"]["prefix_caching"] == "config"
            assert credits(await burst(http, url)) == [0] * CONCURRENT
    finally:
        engine.stop()
