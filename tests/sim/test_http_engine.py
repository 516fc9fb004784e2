"""The engine's KV behaviour seen over real HTTP: blocks, admission, preemption, disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import openai

from tests.sim.conftest import SimFactory, blocks, metrics, state, wait_idle

PROMPT_6 = [100, 101, 102, 103, 104, 105]  # token ids: an exact 6-token prompt


async def test_a_request_holds_ceil_tokens_over_block_size_as_it_grows(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(num_gpu_blocks=33, block_size=4, max_model_len=64, decode_ms_base=40) as url:
        seen: set[tuple[int, int]] = set()
        body = {"model": "tiny", "prompt": PROMPT_6, "max_tokens": 12, "ignore_eos": True}
        async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}):
            # Sample the scheduler while the request generates.
            while True:
                st = await state(client, url)
                if not st["requests"]:
                    break
                (req,) = st["requests"]
                assert req["num_blocks"] == blocks(req["num_tokens"], 4)
                assert st["used_blocks"] == req["num_blocks"]
                assert st["kv_cache_usage"] == req["num_blocks"] / 32  # 32 usable blocks
                # /metrics is a separate call (the engine may have moved on): same unit.
                usage = (await metrics(client, url))["vllm:kv_cache_usage_perc"]
                assert usage * 32 in (0, 2, 3, 4, 5)
                seen.add((req["num_tokens"], req["num_blocks"]))
                await asyncio.sleep(0.005)
        # Prompt 6 + up to 11 fed-back tokens: 2 blocks at first, 5 at the end.
        assert min(b for _, b in seen) == 2
        assert max(b for _, b in seen) >= 4
        idle = await wait_idle(client, url)
        assert idle["used_blocks"] == 0
        assert (await metrics(client, url))["vllm:kv_cache_usage_perc"] == 0.0


async def test_with_n_blocks_and_k_block_requests_at_most_n_over_k_run(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    # 9 blocks = 8 usable (one is vLLM's null block); each request needs k = 3 blocks of 4
    # tokens (9-token prompt + 3 output tokens, KV <= 11 tokens) -> at most 8 // 3 = 2 run.
    # Without prefix caching: with it, the six identical prompts would share their 2 full
    # blocks (see test_http_prefix_cache.py).
    async with sim(
        num_gpu_blocks=9,
        block_size=4,
        max_model_len=32,
        decode_ms_base=60,
        enable_prefix_caching=False,
    ) as url:
        body = {"model": "tiny", "prompt": list(range(200, 209)), "max_tokens": 3}
        body["ignore_eos"] = True
        tasks = [
            asyncio.create_task(client.post(f"{url}/v1/completions", json=body)) for _ in range(6)
        ]
        max_running = max_waiting = 0.0
        while not all(t.done() for t in tasks):
            m = await metrics(client, url)
            max_running = max(max_running, m["vllm:num_requests_running"])
            max_waiting = max(max_waiting, m["vllm:num_requests_waiting"])
            assert m["vllm:kv_cache_usage_perc"] <= 6 / 8
            await asyncio.sleep(0.005)
        answers = [t.result() for t in tasks]
        assert all(a.status_code == 200 for a in answers)
        assert max_running == 2
        assert max_waiting >= 3
        m = await metrics(client, url)
        assert m["vllm:num_preemptions_total"] == 0
        assert m["vllm:request_success_total{finished_reason=length}"] == 6


async def test_overload_preempts_and_the_metric_counts_it(sim: SimFactory) -> None:
    # 5 usable blocks of 16 tokens; 10 requests that each start in 1 block and grow to 3.
    async with sim(num_gpu_blocks=6, block_size=16, max_model_len=64, max_num_seqs=8) as url:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        calls = [
            api.completions.create(
                model="tiny", prompt=PROMPT_6, max_tokens=40, extra_body={"ignore_eos": True}
            )
            for _ in range(10)
        ]
        results = await asyncio.gather(*calls)
        assert all(r.usage is not None and r.usage.completion_tokens == 40 for r in results)
        async with httpx.AsyncClient() as client:
            m = await metrics(client, url)
            assert m["vllm:num_preemptions_total"] > 0
            assert m["vllm:generation_tokens_total"] == 400
            assert m["vllm:prompt_tokens_total"] == 60  # recomputation is not counted
            assert m["vllm:kv_cache_usage_perc"] == 0.0
            assert (await wait_idle(client, url))["used_blocks"] == 0
        await api.close()


async def test_a_streaming_client_that_disconnects_frees_its_blocks(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(num_gpu_blocks=65, block_size=4, max_model_len=256, decode_ms_base=5) as url:
        body = {"model": "tiny", "prompt": PROMPT_6, "max_tokens": 200, "ignore_eos": True}
        async with client.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True}
        ) as response:
            lines = response.aiter_lines()
            got = 0
            async for line in lines:
                if line.startswith("data: "):
                    got += 1
                    if got == 3:
                        break
            st = await state(client, url)
            assert st["running"] == 1 and st["used_blocks"] >= 2
        # Leaving the block closed the connection.
        idle = await wait_idle(client, url)
        assert idle["used_blocks"] == 0
        m = await metrics(client, url)
        assert m["vllm:request_success_total{finished_reason=abort}"] == 1
        assert m["vllm:kv_cache_usage_perc"] == 0.0


async def test_a_non_streaming_client_that_disconnects_frees_its_blocks(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(num_gpu_blocks=65, block_size=4, max_model_len=256, decode_ms_base=5) as url:
        body = {"model": "tiny", "prompt": PROMPT_6, "max_tokens": 200, "ignore_eos": True}
        try:
            await client.post(f"{url}/v1/completions", json=body, timeout=0.2)
            raise AssertionError("expected a timeout")
        except httpx.ReadTimeout:
            pass
        idle = await wait_idle(client, url)
        assert idle["used_blocks"] == 0
        m = await metrics(client, url)
        assert m["vllm:request_success_total{finished_reason=abort}"] == 1


async def test_a_waiting_request_that_disconnects_leaves_the_queue(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(
        num_gpu_blocks=9, block_size=4, max_num_seqs=1, max_model_len=32, decode_ms_base=10
    ) as url:
        body = {"model": "tiny", "prompt": PROMPT_6, "max_tokens": 20, "ignore_eos": True}
        first = asyncio.create_task(client.post(f"{url}/v1/completions", json=body))
        await asyncio.sleep(0.05)
        with contextlib.suppress(httpx.ReadTimeout):
            await client.post(f"{url}/v1/completions", json=body, timeout=0.1)
        assert (await first).status_code == 200
        m = await metrics(client, url)
        assert m["vllm:request_success_total{finished_reason=abort}"] == 1
        assert m["vllm:request_success_total{finished_reason=length}"] == 1
        assert (await wait_idle(client, url))["used_blocks"] == 0


async def test_time_to_first_token_is_observed(sim: SimFactory, client: httpx.AsyncClient) -> None:
    async with sim() as url:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        for _ in range(3):
            assert (await client.post(f"{url}/v1/completions", json=body)).status_code == 200
        m = await metrics(client, url)
        assert m["vllm:time_to_first_token_seconds_count"] == 3
        assert m["vllm:time_to_first_token_seconds_bucket{le=+Inf}"] == 3
        assert json.dumps(m)  # plain floats
