"""Simulated engines as subprocesses, for tests that kill and restart them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Child:
    """A server of ours as a subprocess: spawned, awaited until it answers, stopped or killed."""

    what = "process"
    ready_path = "/health"

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.log = tempfile.NamedTemporaryFile(prefix=f"{self.what}-{self.port}-", suffix=".log")  # noqa: SIM115
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    async def _spawn(self, argv: list[str], timeout_s: float = 60) -> None:
        # Popen only forks; waiting for the server to answer is asynchronous below.
        self.proc = subprocess.Popen(  # noqa: ASYNC220
            argv, stdout=self.log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient() as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.what} exited: {self.log_text()[-3000:]}")
                try:
                    if (await client.get(self.url + self.ready_path)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.05)
        raise RuntimeError(
            f"{self.what} not ready within {timeout_s:g} s: {self.log_text()[-3000:]}"
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


class SimProcess(_Child):
    """`python -m gateway.sim` with the given flags (restartable with other flags)."""

    what = "sim"

    def __init__(self, port: int | None = None, **flags: object) -> None:
        super().__init__(port)
        self.flags = flags

    async def start(self, **flags: object) -> SimProcess:
        self.flags.update(flags)
        argv = [sys.executable, "-m", "gateway.sim", "--port", str(self.port)]
        argv += ["--log-level", "warning"]
        for key, value in self.flags.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        await self._spawn(argv, timeout_s=30)
        return self


class GatewayProcess(_Child):
    """`kv-gateway serve` as a subprocess (a replica), from a config dict."""

    what = "gateway"
    ready_path = "/ready"

    def __init__(self, config: dict[str, object], workdir: Path) -> None:
        super().__init__()
        self.config_path = workdir / f"gateway-{self.port}.yaml"
        self.config_path.write_text(json.dumps(config))  # JSON is YAML

    async def start(self) -> GatewayProcess:
        argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(self.config_path)]
        argv += ["--port", str(self.port), "--log-level", "warning"]
        await self._spawn(argv)
        return self


class RedisServer:
    """A private redis-server on its own port, for tests that stop and restart Redis (the
    shared one at 6379 must stay up for everyone else)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
