"""A real vLLM started with --max-num-queued-reqs refuses at its front door (503); through the
gateway those refusals are "full now", waited out in the line, never the client's error."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e import conftest
from tests.e2e.gateway_process import GatewayProcess, gateway_config

pytestmark = pytest.mark.vllm

QUEUED_REQS = 2
BLOCKS = 32  # 4 MiB: room for all 8 at once, so only the front door refuses


@pytest.fixture(scope="module")
def refusing_engine(
    vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    with conftest.own_engine(
        vllm_model_dir,
        tmp_path_factory.mktemp("vllm-refusing"),
        kv_cache_memory_bytes=BLOCKS * conftest.BLOCK_SIZE * 1024,
        extra_args=["--max-num-queued-reqs", str(QUEUED_REQS)],
    ) as url:
        yield url


def _rejections(url: str) -> float:
    """vLLM's count of front-door refusals (`vllm:admission_rejections_total`, all reasons)."""
    page = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith("vllm:admission_rejections_total")
    )


async def _burst(url: str, n: int) -> list[int]:
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 64, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120) as http:
        answers = await asyncio.gather(
            *(http.post(url + "/v1/completions", json=body) for _ in range(n))
        )
    return [a.status_code for a in answers]


def test_refusals_reach_no_client_through_the_gateway(refusing_engine: str, tmp_path: Path) -> None:
    direct = asyncio.run(_burst(refusing_engine, 8))
    assert 503 in direct, direct  # the engine does refuse a burst sent to it directly
    config = gateway_config(
        refusing_engine,
        engine={"num_gpu_blocks": BLOCKS, "block_size": 128, "max_num_seqs": conftest.MAX_NUM_SEQS},
    )
    before = _rejections(refusing_engine)
    with GatewayProcess(config, tmp_path) as gateway:
        through = asyncio.run(_burst(gateway.url, 8))
        metrics = httpx.get(gateway.url + "/metrics", timeout=10).text
    assert through == [200] * 8, (through, gateway.log_tail())
    assert "kv_gateway_engine_refusals_total" in metrics
    refused = _rejections(refusing_engine) - before
    assert refused > 0  # the engine refused the gateway too, and no client saw it
    conftest.record_figure(
        "front-door refusals (--max-num-queued-reqs 2, 8 at once)",
        f"direct {direct.count(503)} of 8 answered 503; through the gateway 0 of 8, "
        f"{refused:g} refusals waited out",
    )
