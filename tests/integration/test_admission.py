"""Overload through the gateway: queue, 429 with Retry-After, no over-commit, no leaks."""

import asyncio
import dataclasses
import random

import httpx
import openai

from tests.integration.conftest import FAST, gateway_over

# 2 engines: 33 and 17 usable... blocks of 16 tokens; each request below takes
# ceil((prompt + 150) / 16) = 10 or 11 blocks, so only a few fit at once.
BIG = dataclasses.replace(
    FAST, num_gpu_blocks=65, max_num_seqs=3, max_model_len=512, decode_ms_base=4.0
)
SMALL = dataclasses.replace(
    FAST, num_gpu_blocks=33, max_num_seqs=2, max_model_len=512, decode_ms_base=4.0
)


async def _complete(http: httpx.AsyncClient, url: str, max_tokens: int = 150) -> httpx.Response:
    return await http.post(
        url + "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "a short prompt",
            "max_tokens": max_tokens,
            "ignore_eos": True,
        },
    )


async def test_burst_is_queued_then_refused_with_retry_after():
    queue = {"max_length": 6, "max_wait_s": 0.25}
    async with gateway_over([BIG, SMALL], queue=queue) as gw:
        async with httpx.AsyncClient(timeout=30) as http:
            results = await asyncio.gather(*(_complete(http, gw.url) for _ in range(40)))
        codes = [r.status_code for r in results]
        assert codes.count(200) >= 5  # what fits, plus the queue's turnover
        refused = [r for r in results if r.status_code == 429]
        assert refused, codes
        assert set(codes) <= {200, 429}
        for r in refused:
            error = r.json()["error"]
            assert error["code"] in ("queue_full", "queue_timeout")
            assert int(r.headers["retry-after"]) >= 1
            assert 1 <= int(r.headers["retry-after-ms"]) <= 300_000
        # 40 arrivals against 5 slots and a queue of 6: some overflow the queue at once, and
        # the queued ones outwait max_wait_s (a generation takes longer than 0.25 s).
        assert {r.json()["error"]["code"] for r in refused} == {"queue_full", "queue_timeout"}
    # The engines never saw more than max_num_seqs, nor more blocks than the gateway's ceiling,
    # and never preempted.
    for i, sim in enumerate([BIG, SMALL]):
        capacity = int((sim.num_gpu_blocks - 1) * 0.95)
        snap = gw.engines[i].sim.engine.snapshot()
        assert 0 < snap.peak_running <= sim.max_num_seqs
        assert 0 < snap.peak_used_blocks <= capacity
        assert snap.num_preemptions == 0


async def test_retry_after_follows_observed_release_rate():
    """After releases have been observed, Retry-After is the queue's drain estimate, not the
    fallback constant."""
    queue = {"max_length": 2, "max_wait_s": 5}
    admission = {"retry_fallback_s": 50, "kv_ceiling": 0.95}
    async with gateway_over([SMALL], queue=queue, admission=admission) as gw:
        async with httpx.AsyncClient(timeout=30) as http:
            # Warm up: a few releases so a rate exists.
            for _ in range(3):
                assert (await _complete(http, gw.url, max_tokens=20)).status_code == 200
            results = await asyncio.gather(*(_complete(http, gw.url) for _ in range(8)))
        refused = [r for r in results if r.status_code == 429]
        assert refused
        for r in refused:
            assert r.json()["error"]["code"] == "queue_full"
            assert float(r.headers["retry-after-ms"]) < 50_000  # not the fallback


async def test_client_cancellations_leave_nothing_reserved():
    """Clients that leave while queued or mid-stream release their reservations; the upstream
    request is closed, which aborts it in the engine."""
    queue = {"max_length": 50, "max_wait_s": 10}
    rng = random.Random(5)
    async with gateway_over([BIG, SMALL], queue=queue) as gw:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=30)

        async def one(i: int) -> str:
            stream = await client.completions.create(
                model="tiny",
                prompt=f"request {i}",
                max_tokens=120,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            got = 0
            async for _ in stream:
                got += 1
                if got >= 10:
                    break  # leave mid-stream
            await stream.close()
            return "left"

        tasks = [asyncio.create_task(one(i)) for i in range(30)]
        await asyncio.sleep(0.3)
        for t in tasks:  # cancel a random third wherever they are (many are still queued)
            if rng.random() < 0.33:
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        # The gateway's ledger and queue are exactly empty ...
        for _ in range(100):
            status = await gw.status()
            if status["queue"]["length"] == 0 and all(
                e["reserved_blocks"] == 0 for e in status["engines"]
            ):
                break
            await asyncio.sleep(0.05)
        assert status["queue"]["length"] == 0
        assert all(e["reserved_blocks"] == 0 and e["reserved_seqs"] == 0 for e in status["engines"])
        # ... and the engines aborted what the clients abandoned.
        for _ in range(100):
            snaps = [e.sim.engine.snapshot() for e in gw.engines]
            if all(s.running == 0 and s.used_blocks == 0 for s in snaps):
                break
            await asyncio.sleep(0.05)
        assert all(s.running == 0 and s.waiting == 0 and s.used_blocks == 0 for s in snaps)
