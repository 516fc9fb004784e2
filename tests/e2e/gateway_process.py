"""The gateway's configuration in front of the real engine, for the end-to-end tests.

The gateway runs as a user runs it (`gateway.harness.GatewayProcess`: its console script, a
YAML file, a TCP port), not in-process, so that the tests exercise exactly what ships.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gateway.harness import GatewayProcess

__all__ = ["TOKENIZER_DIR", "GatewayProcess", "gateway_config", "serving_gateway"]


REPO = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO / "gateway" / "assets" / "tiny-tokenizer"


def gateway_config(engine_url: str, *, engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config of the key result: one engine of 6 x 128-token blocks, worst-case reservations
    up to the whole usable pool, a queue long and patient enough to hold the overload."""
    if engine is None:
        engine = {
            "num_gpu_blocks": 6,
            "block_size": 128,
            "max_num_seqs": 8,
            "max_model_len": 512,
        }
    return {
        "engines": [{"name": "vllm0", "url": engine_url, **engine}],
        "models": [{"name": "tiny", "tokenizer": f"hf:{TOKENIZER_DIR}"}],
        "queue": {"max_length": 100, "max_wait_s": 60},
        "admission": {"kv_ceiling": 1.0, "reservation": "worst_case"},
    }


@contextmanager
def serving_gateway(config: dict[str, Any], workdir: Path) -> Iterator[GatewayProcess]:
    """`kv-gateway serve` with `config` for the length of the block (a failed start fails the
    test with the gateway's own words)."""
    process = GatewayProcess(config, workdir)
    try:
        process.start()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield process
    finally:
        process.stop()
