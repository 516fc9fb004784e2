"""An engine that refuses at its own front door (vLLM's --max-num-queued-reqs: 503) is full,
not failed: its refusals never reach the client while the line can wait for it."""

import asyncio
import dataclasses

import httpx

from tests.integration.conftest import FAST, gateway_over

# The engine runs 4 at once but takes at most 2 unfinished requests at its front door; the
# gateway is told max_num_seqs 4, so it sends more than the engine accepts.
SIM = dataclasses.replace(
    FAST, max_num_seqs=4, max_model_len=512, num_gpu_blocks=257, decode_ms_base=5.0,
    max_num_queued_reqs=2,
)  # fmt: skip


async def test_front_door_refusals_wait_in_line_and_all_complete() -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 40, "ignore_eos": True}
    async with gateway_over([SIM]) as gw, httpx.AsyncClient(timeout=60) as http:
        answers = await asyncio.gather(
            *(http.post(gw.url + "/v1/completions", json=body) for _ in range(10))
        )
        assert [a.status_code for a in answers] == [200] * 10
        metrics = (await http.get(gw.url + "/metrics")).text
        engine_metrics = (await http.get(gw.engines[0].url + "/metrics")).text
        assert (await gw.reserved_blocks_settle()) == [0]
    refusals = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("kv_gateway_engine_refusals_total")
    ]
    assert refusals and refusals[0] > 0  # the engine did refuse, and nobody saw it
    assert "vllm:admission_rejections_total" in engine_metrics
