"""Simulated engines as subprocesses, for tests that kill and restart them."""

from __future__ import annotations

import asyncio
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
