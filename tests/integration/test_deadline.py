"""Admission by deadline over loopback (issue 40, Deliver 3): a simulated engine with known
step costs in its own process, the gateway in this one with the same costs configured and
calibration off (so the predictions are the configured model's, not a fit that moves).

* A request whose TTFT target no engine can meet even idle is refused at once: 429
  `slo_unattainable` in the OpenAI error shape, with `Retry-After`, counted per class.
* A TPOT target caps the batch: the step time with one more sequence must stay within it,
  so the engine never runs more sequences than that, whatever its `max_num_seqs`; the
  others wait in the line and go as streams end.
* Best effort (no class) is kept off an engine where it would break a running request's
  TPOT target.
* A request whose turn, forecast from the running requests' output budgets, comes after its
  deadline is refused at once, even first in line.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import parse_config
from gateway.embedded import running_app
from gateway.harness import SimProcess
from gateway.http.app import create_app
from gateway.runtime import build_runtime

HEADER = "x-kv-gateway-service-class"
# 10 ms a step + 5 ms a sequence: a step of n sequences takes 10 + 5n ms. With the TPOT
# target of 32 ms, one more sequence fits while 10 + 5(n + 1) <= 32: at most 4 running.
COSTS = {
    "base_ms": 10.0,
    "per_seq_ms": 5.0,
    "per_prefill_token_ms": 0.01,
    "chunk_tokens": 512,
    "overhead_ms": 1.0,
}
MOST = 4


def simulator() -> SimProcess:
    return SimProcess(
        block_size=16,
        max_model_len=2048,
        num_gpu_blocks=2048,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        decode_ms_base=10.0,
        decode_ms_per_seq=5.0,
        prefill_ms_per_token=0.01,
        seed=1,
    )


@contextlib.asynccontextmanager
async def gateway_with(sim: SimProcess) -> AsyncIterator[str]:
    raw: dict[str, Any] = {
        "engines": [{"url": sim.url, "name": "sim"}],
        "models": [{"name": "tiny", "tokenizer": "hf:@tiny"}],
        "health": {"scrape_interval_s": 0.25, "timeout_s": 2.0},
        "queue": {"max_wait_s": 30},
        "slo": {
            "classes": {
                "steady": {"tpot_s": 0.032},
                "instant": {"ttft_s": 0.005},
                "interactive": {"ttft_s": 5.0, "tpot_s": 0.032},
                "soon": {"ttft_s": 1.0, "tpot_s": 0.032},
            },
            "step_costs": COSTS,
            "calibrate": False,
        },
    }
    runtime = await build_runtime(parse_config(raw))
    async with running_app(create_app(runtime)) as url:
        yield url


def slo_counts(text: str) -> dict[tuple[str, str], float]:
    return {
        (s.labels["class"], s.labels["outcome"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kv_gateway_slo_requests_total"
    }


async def running_on(sim_url: str, http: httpx.AsyncClient) -> float:
    text = (await http.get(sim_url + "/metrics")).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:num_requests_running"
    )


async def test_an_unattainable_ttft_is_refused_at_once():
    sim = simulator()
    await sim.astart()
    try:
        async with gateway_with(sim) as url, httpx.AsyncClient(timeout=30) as http:
            started = time.monotonic()
            r = await http.post(
                url + "/v1/completions",
                json={"model": "tiny", "prompt": "hello " * 50, "max_tokens": 8},
                headers={HEADER: "instant"},
            )
            took = time.monotonic() - started
            assert r.status_code == 429, r.text
            error = r.json()["error"]
            assert error["code"] == "slo_unattainable" and error["type"] == "rate_limit_exceeded"
            assert "target" in error["message"]
            assert int(r.headers["retry-after"]) >= 1
            assert took < 1.0  # at once: an idle engine needs >= 11 ms for its first token
            counts = slo_counts((await http.get(url + "/metrics")).text)
            assert counts[("instant", "refused")] == 1
            assert counts[("instant", "admitted")] == 0
    finally:
        sim.stop()


async def test_a_tpot_target_caps_the_batch_and_the_rest_wait():
    sim = simulator()
    await sim.astart()
    try:
        async with gateway_with(sim) as url, httpx.AsyncClient(timeout=60) as http:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

            async def stream(i: int) -> int:
                got = await client.completions.create(
                    model="tiny",
                    prompt=f"request {i} " + "word " * 20,
                    max_tokens=40,
                    stream=True,
                    extra_body={"ignore_eos": True},
                    extra_headers={HEADER: "steady"},
                )
                tokens = 0
                async for chunk in got:
                    tokens += sum(1 for c in chunk.choices if c.text)
                return tokens

            tasks = [asyncio.create_task(stream(i)) for i in range(10)]
            peak = 0.0
            while not all(t.done() for t in tasks):
                peak = max(peak, await running_on(sim.url, http))
                await asyncio.sleep(0.02)
            results = await asyncio.gather(*tasks)
            await client.close()
            assert all(n > 0 for n in results), results  # all served, none refused
            # Without the gate all 10 would run at once (max_num_seqs 16, blocks ample).
            assert 1 <= peak <= MOST, peak
            counts = slo_counts((await http.get(url + "/metrics")).text)
            assert counts[("steady", "admitted")] == 10
    finally:
        sim.stop()


async def test_best_effort_is_kept_off_a_batch_at_its_tpot_target():
    sim = simulator()
    await sim.astart()
    try:
        async with gateway_with(sim) as url, httpx.AsyncClient(timeout=60) as http:

            async def one(headers: dict[str, str], tokens: int) -> float:
                began = time.monotonic()
                r = await http.post(
                    url + "/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": "x " * 20,
                        "max_tokens": tokens,
                        "ignore_eos": True,
                    },
                    headers=headers,
                )
                assert r.status_code == 200, r.text
                return time.monotonic() - began

            # Four interactive requests fill the batch to its target (10 + 5 × 4 = 30 ms).
            held = [asyncio.create_task(one({HEADER: "interactive"}, 60)) for _ in range(MOST)]
            for _ in range(200):
                if await running_on(sim.url, http) >= MOST:
                    break
                await asyncio.sleep(0.01)
            assert await running_on(sim.url, http) == MOST
            # A best-effort request now would make every step 35 ms: it waits for one of
            # them to end, so it cannot start before they do.
            waited = asyncio.create_task(one({}, 2))
            await asyncio.sleep(0.3)
            assert not waited.done()
            assert await running_on(sim.url, http) == MOST
            await asyncio.gather(*held)
            assert await asyncio.wait_for(waited, 10) > 0.3
    finally:
        sim.stop()


async def test_a_turn_forecast_past_the_deadline_is_refused_at_once():
    """Four streams of 200 tokens fill the batch to its TPOT target (30 ms a step: about 6 s
    each). A request with a 1 s TTFT target must wait for one of them to end (a fifth would
    make every step 35 ms), and the first end is forecast seconds away: refused at once, not
    after waiting until an idle engine could no longer make it (~1 s, the rule before)."""
    sim = simulator()
    await sim.astart()
    try:
        async with gateway_with(sim) as url, httpx.AsyncClient(timeout=60) as http:

            async def long(i: int) -> int:
                r = await http.post(
                    url + "/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": f"long {i} " + "x " * 20,
                        "max_tokens": 200,
                        "ignore_eos": True,
                    },
                    headers={HEADER: "steady"},
                )
                return r.status_code

            held = [asyncio.create_task(long(i)) for i in range(MOST)]
            for _ in range(200):
                if await running_on(sim.url, http) >= MOST:
                    break
                await asyncio.sleep(0.01)
            assert await running_on(sim.url, http) == MOST
            await asyncio.sleep(0.2)  # past their first tokens: their ends are forecast
            started = time.monotonic()
            r = await http.post(
                url + "/v1/completions",
                json={"model": "tiny", "prompt": "hello " * 20, "max_tokens": 8},
                headers={HEADER: "soon"},
            )
            took = time.monotonic() - started
            assert r.status_code == 429, r.text
            error = r.json()["error"]
            assert error["code"] == "slo_unattainable", error
            assert "turn is expected in" in error["message"], error["message"]
            assert took < 0.5, took  # at once
            assert int(r.headers["retry-after"]) >= 1
            assert await asyncio.gather(*held) == [200] * MOST
    finally:
        sim.stop()
