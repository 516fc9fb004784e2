"""`kv-gateway serve` as a subprocess in front of the real engine, for the end-to-end tests.

The gateway runs as a user runs it (its console script, a YAML file, a TCP port), not in-process,
so that the test exercises exactly what ships.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import yaml

from tools.vllm.engine import die_with_parent, free_port

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


class GatewayProcess:
    """One `kv-gateway serve` subprocess; `start()` returns once its /health answers 200."""

    def __init__(
        self, config: dict[str, Any], workdir: Path, *, startup_timeout_s: float = 60.0
    ) -> None:
        self.port = free_port()
        self.config_path = workdir / f"gateway-{self.port}.yaml"
        self.log_path = workdir / f"gateway-{self.port}.log"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"GatewayProcess({self.url}, config={self.config_path})"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        script = Path(sys.executable).with_name("kv-gateway")
        return [
            str(script),
            "serve",
            "--config",
            str(self.config_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
        ]

    def start(self) -> GatewayProcess:
        deadline = time.monotonic() + self.startup_timeout_s
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
        with httpx.Client(timeout=2.0) as client:
            while True:
                if self._proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"kv-gateway exited before /health\n{self.log_tail()}")
                with contextlib.suppress(httpx.TransportError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        return self
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"kv-gateway /health not 200 in time\n{self.log_tail()}")
                time.sleep(0.2)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def status(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/admin/status", timeout=10)
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
