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


class SimProcess:
    def __init__(self, port: int | None = None, **flags: object) -> None:
        self.port = port or free_port()
        self.flags = flags
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tempfile.NamedTemporaryFile(prefix=f"sim-{self.port}-", suffix=".log")  # noqa: SIM115

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, **flags: object) -> SimProcess:
        self.flags.update(flags)
        argv = [
            sys.executable,
            "-m",
            "gateway.sim",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
        ]
        for key, value in self.flags.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        # Popen only forks; the wait for the engine to answer is asynchronous below.
        self.proc = subprocess.Popen(  # noqa: ASYNC220
            argv, stdout=subprocess.DEVNULL, stderr=self.log
        )
        deadline = time.monotonic() + 30
        async with httpx.AsyncClient() as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    err = Path(self.log.name).read_text(errors="replace")  # noqa: ASYNC240
                    raise RuntimeError(f"simulated engine exited: {err[-2000:]}")
                try:
                    if (await client.get(self.url + "/health")).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.05)
        raise RuntimeError("simulated engine did not start within 30 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


class GatewayProcess:
    """`kv-gateway serve` as a subprocess (a replica), from a config dict."""

    def __init__(self, config: dict[str, object], workdir: Path) -> None:
        self.port = free_port()
        self.config_path = workdir / f"gateway-{self.port}.yaml"
        self.config_path.write_text(json.dumps(config))  # JSON is YAML
        self.log = tempfile.NamedTemporaryFile(prefix=f"gw-{self.port}-", suffix=".log")  # noqa: SIM115
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> GatewayProcess:
        argv = [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--config",
            str(self.config_path),
            "--port",
            str(self.port),
            "--log-level",
            "warning",
        ]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)  # noqa: ASYNC220
        deadline = time.monotonic() + 60
        async with httpx.AsyncClient() as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"gateway exited: {self.log_text()[-3000:]}")
                try:
                    if (await client.get(self.url + "/ready")).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.05)
        raise RuntimeError(f"gateway not ready within 60 s: {self.log_text()[-3000:]}")

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

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
