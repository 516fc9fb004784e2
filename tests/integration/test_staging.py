"""Staged sequences: `admission.staged_seqs` of the gateway's requests wait inside the engine
beyond its `max_num_seqs`, so that a slot a finishing sequence frees is taken at the engine's
next step, as when clients go direct, not after a round trip through the gateway. The engine
never runs more than `max_num_seqs`, and with worst-case reservations never preempts."""

import asyncio
import dataclasses
from typing import Any

import httpx
import pytest

from tests.integration.conftest import FAST, gateway_over

# One engine, 4 sequence slots, 63 usable blocks of 16 tokens; 10 ms a step.
SLOW = dataclasses.replace(
    FAST, num_gpu_blocks=64, max_num_seqs=4, max_model_len=512, decode_ms_base=10.0
)


def body(max_tokens: int) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": "a short prompt",
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }


@pytest.mark.parametrize("staged", [0, 2])
async def test_staged_requests_wait_inside_the_engine_never_beyond_it(staged: int) -> None:
    admission = {"reservation": "worst_case", "staged_seqs": staged}
    async with (
        gateway_over([SLOW], admission=admission) as gw,
        httpx.AsyncClient(timeout=60) as http,
    ):
        # 9 requests of ceil((4 + 60) / 16) = 4 blocks: 36 of 63 blocks, so slots decide.
        tasks = [
            asyncio.create_task(http.post(gw.url + "/v1/completions", json=body(60)))
            for _ in range(9)
        ]
        engine = gw.engines[0].sim.engine
        peak_waiting = peak_reserved = 0
        while not all(t.done() for t in tasks):
            snap = engine.snapshot()
            assert snap.running <= SLOW.max_num_seqs
            assert snap.running + snap.waiting <= SLOW.max_num_seqs + staged
            peak_waiting = max(peak_waiting, snap.waiting)
            status = (await gw.status())["engines"][0]
            peak_reserved = max(peak_reserved, status["reserved_seqs"])
            await asyncio.sleep(0.005)
        assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * 9
        snap = engine.snapshot()
    assert peak_reserved == SLOW.max_num_seqs + staged
    # The staged did wait inside the engine (a request that arrives mid-step waits for the
    # step's end whether staged or not, so an unstaged run may see one waiting too).
    assert peak_waiting >= staged
    assert snap.num_preemptions == 0 and snap.peak_running == SLOW.max_num_seqs


async def test_a_max_num_seqs_below_the_engines_own_stops_staging() -> None:
    # Configured 2, the engine runs 8: the staged requests run instead of waiting. Once a
    # scrape shows it, the gateway stages nothing there and the cap holds.
    roomy = dataclasses.replace(SLOW, max_num_seqs=8)
    async with (
        gateway_over(
            [roomy],
            engine_settings=[{"max_num_seqs": 2}],
            admission={"staged_seqs": 2},
            health={"scrape_interval_s": 0.1},
        ) as gw,
        httpx.AsyncClient(timeout=60) as http,
    ):
        assert (await gw.status())["engines"][0]["staged_seqs"] == 2
        first = [
            asyncio.create_task(http.post(gw.url + "/v1/completions", json=body(60)))
            for _ in range(6)
        ]
        assert [r.status_code for r in await asyncio.gather(*first)] == [200] * 6
        status = (await gw.status())["engines"][0]
        assert status["staged_seqs"] == 0, status
        engine = gw.engines[0].sim.engine
        engine.peak_running = 0
        second = [
            asyncio.create_task(http.post(gw.url + "/v1/completions", json=body(60)))
            for _ in range(6)
        ]
        assert [r.status_code for r in await asyncio.gather(*second)] == [200] * 6
        assert engine.snapshot().peak_running == 2
