"""Fixtures for running the tool over real HTTP: a simulated engine and a gateway as child
processes (`gateway.harness`), scripted servers in a thread, and the CLI called as users do."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette

from gateway.cli import main
from gateway.harness import GatewayProcess, SimProcess, free_port

# Fast enough for short runs, slow enough that time to first token is a few ms.
SIM_FLAGS: dict[str, Any] = {
    "num_gpu_blocks": 512,
    "block_size": 16,
    "max_num_seqs": 64,
    "max_model_len": 2048,
    "prefill_ms_per_token": 0.005,
    "decode_ms_base": 1.0,
    "decode_ms_per_seq": 0.05,
}


@pytest.fixture(scope="package")
def sim() -> Iterator[SimProcess]:
    with SimProcess(**SIM_FLAGS) as engine:
        yield engine


@pytest.fixture(scope="package")
def gateway(sim: SimProcess) -> Iterator[GatewayProcess]:
    """A gateway whose short queue refuses part of a burst (429 queue_full, Retry-After)."""
    config = {
        "engines": [{"name": "e0", "url": sim.url, "max_num_seqs": 4}],
        "models": [{"name": "tiny", "tokenizer": "hf:@tiny"}],
        "queue": {"max_length": 2, "max_wait_s": 10},
        # max_num_seqs 4 is a cap below the engine's 64: nothing staged beyond it.
        "admission": {"staged_seqs": 0},
    }
    with GatewayProcess(config) as process:
        yield process


class ThreadServer:
    """An ASGI app on a loopback port, served by uvicorn in a thread of this process."""

    def __init__(self, app: Starlette) -> None:
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("scripted server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def serve() -> Iterator[Callable[[Starlette], str]]:
    servers: list[ThreadServer] = []

    def start(app: Starlette) -> str:
        servers.append(ThreadServer(app).__enter__())
        return servers[-1].url

    yield start
    for server in servers:
        server.__exit__()


def run_tool(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str
) -> tuple[int, dict[str, Any], str]:
    """`kv-gateway loadtest ...` as a user runs it; returns (exit code, JSON report, stderr)."""
    out = tmp_path / "report.json"
    code = main(["loadtest", *argv, "--json", str(out), "--quiet"])
    err = capsys.readouterr().err
    report = json.loads(out.read_text()) if out.exists() else {}
    return code, report, err
