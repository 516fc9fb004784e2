"""The planner's block count for the engine's KV byte budget equals what the real engine has."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from tests.e2e import conftest
from tests.e2e.engine_metrics import scrape

pytestmark = pytest.mark.vllm


def test_planner_blocks_equal_the_real_engines(
    vllm_url: str, vllm_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "plan",
            "--model", str(vllm_model_dir / "config.json"),
            "--gpu-memory-gib", "24",
            "--kv-cache-memory-bytes", str(conftest.KV_CACHE_MEMORY_BYTES),
            "--block-size", str(conftest.BLOCK_SIZE),
            "--dtype", "float32",
            "--max-model-len", str(conftest.MAX_MODEL_LEN),
            "--json",
        ]
    )  # fmt: skip
    assert code == 0
    planned = json.loads(capsys.readouterr().out)["kv"]
    engine = scrape(vllm_url)
    assert planned["num_gpu_blocks"] == engine.num_gpu_blocks == conftest.NUM_GPU_BLOCKS
    assert planned["bytes_per_token"] * conftest.BLOCK_SIZE == planned["block_bytes"]
    assert planned["max_concurrency_at_max_model_len"] == 1.5  # vLLM's own log: "1.50x"
    conftest.record_figure(
        "planner vs engine",
        f"planned {planned['num_gpu_blocks']} blocks, engine reports "
        f"{engine.num_gpu_blocks} for {conftest.KV_CACHE_MEMORY_BYTES} KV bytes",
    )
