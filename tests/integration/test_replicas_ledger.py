"""Ledger first across replicas: one replica's requests are the fleet's own, never foreign to
another replica (their leases are in the shared Redis ledger), so they are counted once."""

import asyncio
import time
import uuid

import httpx
import pytest

from gateway.harness import GatewayProcess, SimProcess
from tests.admin import ADMIN_HEADERS, with_admin
from tests.redis_server import redis_url

pytestmark = pytest.mark.redis


def body(max_tokens: int) -> dict[str, object]:
    return {"model": "tiny", "prompt": list(range(100, 110)), "max_tokens": max_tokens,
            "ignore_eos": True}  # fmt: skip


async def test_another_replicas_requests_are_not_foreign(tmp_path) -> None:
    engine = await SimProcess(
        num_gpu_blocks=257, max_num_seqs=4, max_model_len=512, decode_ms_base=25.0
    ).astart()
    cfg = with_admin(
        {
            "engines": [{"name": "e0", "url": engine.url, "max_num_seqs": 4}],
            "models": [{"name": "tiny", "tokenizer": "hf:@tiny"}],
            "admission": {"staged_seqs": 0},
            "redis": {"url": redis_url(), "key_prefix": f"t{uuid.uuid4().hex[:10]}",
                      "timeout_s": 3},
            "health": {"scrape_interval_s": 0.2},
        }
    )  # fmt: skip
    a, b = GatewayProcess(cfg, tmp_path), GatewayProcess(cfg, tmp_path)
    try:
        await asyncio.gather(a.astart(), b.astart())
        async with httpx.AsyncClient(timeout=60) as http:
            # Four requests of 300 tokens through A: 7.5 s of the engine's 4 slots.
            held = [
                asyncio.create_task(http.post(a.url + "/v1/completions", json=body(300)))
                for _ in range(4)
            ]
            deadline = time.monotonic() + 5
            while True:
                seen = (await http.get(b.url + "/admin/status", headers=ADMIN_HEADERS)).json()
                e = seen["engines"][0]
                if e["reported"]["running"] == 4:
                    break
                assert time.monotonic() < deadline, e
                await asyncio.sleep(0.05)
            # B's scrape saw the engine full; the shared ledger says all four are the fleet's.
            assert e["reserved_seqs"] == 4 and e["foreign"] == {"seqs": 0, "blocks": 0}, e
            # B admits nothing more until a slot is given back: its request waits.
            started = time.monotonic()
            waited = await http.post(b.url + "/v1/completions", json=body(2))
            assert waited.status_code == 200
            assert time.monotonic() - started > 1.0
            assert all(r.status_code == 200 for r in await asyncio.gather(*held))
            state = (await http.get(engine.url + "/sim/state")).json()
            assert state["peak_running"] <= 4 and state["num_preemptions"] == 0
    finally:
        a.stop()
        b.stop()
        engine.stop()
