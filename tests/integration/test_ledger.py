"""Ledger first: what the gateway's own requests give back is free at once; what a direct
client holds is counted (never twice, never forgotten); a partial `/metrics` is not fatal."""

import asyncio
import dataclasses
import time
from typing import Any

import httpx
import pytest

from tests.integration.conftest import FAST, Gateway, gateway_over

# One engine, 4 sequence slots, 63 usable blocks of 16 tokens, 512-token context; ~10 ms a step.
SLOW = dataclasses.replace(
    FAST, num_gpu_blocks=64, max_num_seqs=4, max_model_len=512, decode_ms_base=10.0
)


def body(max_tokens: int, prompt: str = "a short prompt") -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}


async def engine_status(gw: Gateway) -> dict[str, Any]:
    engine: dict[str, Any] = (await gw.status())["engines"][0]
    return engine


async def wait_until(predicate: Any, within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not await predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_slots_given_back_are_reused_before_the_next_scrape() -> None:
    # Scrapes every 3 s: a slot the gateway's own request gave back must not wait for one.
    # 150 tokens at 40 ms a step: the four run together for 6 s, so some scrape sees them all.
    health = {"scrape_interval_s": 3.0}
    slower = dataclasses.replace(SLOW, decode_ms_base=40.0)
    async with gateway_over([slower], health=health) as gw, httpx.AsyncClient(timeout=30) as http:
        first = [
            asyncio.create_task(http.post(gw.url + "/v1/completions", json=body(150)))
            for _ in range(4)
        ]

        async def scraped_busy() -> bool:
            return (await engine_status(gw))["reported"]["running"] == 4

        await wait_until(scraped_busy, 10, "no scrape saw the 4 running requests")
        assert all(r.status_code == 200 for r in await asyncio.gather(*first))
        # The last scrape saw 4 running; all 4 slots are back in the ledger now.
        started = time.monotonic()
        again = await asyncio.gather(
            *(http.post(gw.url + "/v1/completions", json=body(2)) for _ in range(4))
        )
        took = time.monotonic() - started
        assert all(r.status_code == 200 for r in again)
        status = await engine_status(gw)
        # Still the same scrape (or one that saw them finish): no wait for it was needed.
        assert took < 2.0, (took, status)
        assert status["foreign"] == {"seqs": 0, "blocks": 0}


async def test_foreign_load_that_ended_keeps_a_request_out_for_a_scrape_not_the_interval() -> None:
    # Scrapes every 30 s: the direct client's load, seen by one scrape, would otherwise keep
    # the gateway's request out until the next (its queue gives up after 10 s: a 429).
    health = {"scrape_interval_s": 30.0}
    admission = {"staged_seqs": 0}
    queue = {"max_wait_s": 10.0}
    async with (
        gateway_over([SLOW], health=health, admission=admission, queue=queue) as gw,
        httpx.AsyncClient(timeout=60) as http,
    ):
        engine_url, sim = gw.engines[0].url, gw.engines[0].sim
        direct = [
            asyncio.create_task(http.post(engine_url + "/v1/completions", json=body(150)))
            for _ in range(SLOW.max_num_seqs)
        ]

        async def all_running() -> bool:
            return bool(sim.engine.snapshot().running == SLOW.max_num_seqs)

        await wait_until(all_running, 10, "the direct requests never all ran")
        await gw.runtime.monitor.probe_all()  # a scrape sees them
        assert (await engine_status(gw))["foreign"]["seqs"] == SLOW.max_num_seqs
        assert [r.status_code for r in await asyncio.gather(*direct)] == [200] * 4
        started = time.monotonic()
        answer = await http.post(gw.url + "/v1/completions", json=body(2))
        took = time.monotonic() - started
        assert answer.status_code == 200, answer.text
        assert took < 5.0, took  # one scrape asked for (0.2 s apart at most), not 30 s
        assert (await engine_status(gw))["foreign"] == {"seqs": 0, "blocks": 0}


@pytest.mark.parametrize("staged", [0, 1])
async def test_a_direct_clients_load_is_counted_once_and_only_what_is_left_is_admitted(
    staged: int,
) -> None:
    health = {"scrape_interval_s": 0.2}
    admission = {"staged_seqs": staged}
    async with (
        gateway_over([SLOW], health=health, admission=admission) as gw,
        httpx.AsyncClient(timeout=60) as http,
    ):
        engine_url = gw.engines[0].url
        # A direct client holds 2 of the 4 slots and ceil((4 + 300) / 16) = 19 blocks each.
        direct = [
            asyncio.create_task(http.post(engine_url + "/v1/completions", json=body(300)))
            for _ in range(2)
        ]

        async def foreign_seen() -> bool:
            return (await engine_status(gw))["foreign"]["seqs"] == 2

        await wait_until(foreign_seen, 10, "the direct client's 2 sequences were never seen")
        seen = (await engine_status(gw))["foreign"]
        assert seen["blocks"] >= 2  # at least their prompts' blocks
        # Through the gateway: 3 requests that each fit alone; only 2 slots are left.
        gated = [
            asyncio.create_task(http.post(gw.url + "/v1/completions", json=body(40)))
            for _ in range(3)
        ]
        peak = 0
        while not all(t.done() for t in gated):
            status = await engine_status(gw)
            peak = max(peak, status["reserved_seqs"])
            running = gw.engines[0].sim.engine.snapshot().running
            assert running <= SLOW.max_num_seqs
            await asyncio.sleep(0.01)
        assert [r.status_code for r in await asyncio.gather(*gated)] == [200, 200, 200]
        await asyncio.gather(*direct)
        # Never more than what the direct client left (and the staged slot), although the
        # gateway's own ledger was empty: the third request waited for a slot.
        assert peak == 2 + staged
        snap = gw.engines[0].sim.engine.snapshot()
        assert snap.num_preemptions == 0 and snap.peak_running <= SLOW.max_num_seqs


async def test_an_engine_without_preemption_metrics_stays_routed_and_is_flagged() -> None:
    sim = dataclasses.replace(SLOW, hidden_metrics=("vllm:num_preemptions_total",))
    async with gateway_over([sim], health={"scrape_interval_s": 0.2}) as gw:

        async def flagged() -> bool:
            return bool((await engine_status(gw))["reported"]["missing"])

        await wait_until(flagged, 10, "the missing metric was never flagged")
        status = await engine_status(gw)
        assert status["healthy"] and status["reported"]["missing"] == ["vllm:num_preemptions_total"]
        async with httpx.AsyncClient(timeout=30) as http:
            reply = await http.post(gw.url + "/v1/completions", json=body(4))
        assert reply.status_code == 200
        assert (await engine_status(gw))["healthy"]
