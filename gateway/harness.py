"""Servers of ours as child processes: the simulator, the gateway, and a private Redis.

One harness for everything that starts them (and `CommandProcess` for any other server started
by a command, such as a real vLLM) — `kv-gateway loadtest compare` and `sweep`, the
integration and end-to-end tests, and the developer benchmarks in `benchmarks/`:

    with SimProcess(num_gpu_blocks=257, max_model_len=512) as engine:      # `start()` on enter
        with GatewayProcess({"engines": [{"url": engine.url}]}) as gateway:
            httpx.get(gateway.url + "/v1/models")

    engine = await SimProcess(num_gpu_blocks=257).astart()                 # inside an event loop

Contract: `start()` / `astart()` return only once the server answers 200 on its ready path,
or raise `StartError` with the tail of its log (and leave no process behind); `stop()`
(SIGTERM, then SIGKILL after a grace period) and `kill()` (SIGKILL: what a crash looks like)
may be called any number of times. On Linux a child also gets SIGTERM when its parent dies,
so a run killed outright leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx
import yaml

STOP_GRACE_S = 15.0


class StartError(RuntimeError):
    """A child exited or did not become ready in time; the message ends with its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (another process may take it before we do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def die_with_parent() -> None:
    """Run in the child before exec: on Linux, have the kernel SIGTERM it when its parent dies."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Child:
    """One server process: spawned with its output in a log file, awaited until it answers.

    `own_group`: the child gets a process group of its own, so a Ctrl-C in the terminal
    reaches only the parent, which then stops its children in order. A group, not a session:
    with the kernel's CFS autogroup (`kernel.sched_autogroup_enabled`, on by default) every
    session is scheduled as one entity, and a child in a session of its own gets a fixed
    share of a contended CPU whatever its thread count. On a 2-core machine that put vLLM's
    API server behind its own engine's threads and made the first tokens of every target
    arrive ~0.5 s late (docs/benchmarks.md, "On the real engine").
    """

    what = "process"

    def __init__(
        self,
        argv: Sequence[str],
        *,
        port: int,
        ready_path: str = "/health",
        workdir: Path | None = None,
        startup_timeout_s: float = 60.0,
        own_group: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.port = port
        self.ready_path = ready_path
        self.startup_timeout_s = startup_timeout_s
        self.own_group = own_group
        self.env = dict(env) if env is not None else None
        self._own_dir: Path | None = None
        if workdir is None:
            workdir = self._own_dir = Path(tempfile.mkdtemp(prefix=f"kvgw-{self.what}-"))
        self.workdir = workdir
        self.log_path = workdir / f"{self.what}-{port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"{type(self).__name__}({self.url}, {state})"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def _spawn(self) -> None:
        if self._own_dir is None and not self.workdir.exists():
            # stop() removed the directory it made itself: a restart makes it again.
            self.workdir.mkdir(parents=True)
            self._own_dir = self.workdir
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                process_group=0 if self.own_group else None,
                preexec_fn=die_with_parent,
                env=self.env,
            )

    def _failed(self, why: str) -> StartError:
        tail = self.log_tail()
        self.stop()
        return StartError(f"{self.what} on port {self.port} {why}:\n{tail}")

    def start(self) -> Self:
        """Spawn and wait (blocking) until the ready path answers 200; returns self."""
        self._spawn()
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                if not self.running:
                    raise self._failed("exited during start-up")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.url + self.ready_path).status_code == 200:
                        return self
                if time.monotonic() > deadline:
                    raise self._failed(f"not ready within {self.startup_timeout_s:g} s")
                time.sleep(0.05)

    async def astart(self) -> Self:
        """`start()` without blocking the event loop (servers in this loop keep answering)."""
        self._spawn()
        deadline = time.monotonic() + self.startup_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if not self.running:
                    raise self._failed("exited during start-up")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.url + self.ready_path)).status_code == 200:
                        return self
                if time.monotonic() > deadline:
                    raise self._failed(f"not ready within {self.startup_timeout_s:g} s")
                await asyncio.sleep(0.05)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM (servers drain), then SIGKILL after `grace_s`; idempotent."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self._own_dir is not None and proc is not None and proc.poll() is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None

    def kill(self) -> None:
        """SIGKILL now, as a crash would (nothing is drained or released)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _flags(flags: Mapping[str, object]) -> list[str]:
    """`{"num_gpu_blocks": 6, "chunked_prefill": False}` → `--num-gpu-blocks 6
    --no-chunked-prefill`; True adds the bare flag, None leaves it out."""
    argv: list[str] = []
    for key, value in flags.items():
        name = key.replace("_", "-")
        if value is True:
            argv.append(f"--{name}")
        elif value is False:
            argv.append(f"--no-{name}")
        elif value is not None:
            argv += [f"--{name}", str(value)]
    return argv


class SimProcess(Child):
    """`python -m gateway.sim` with the given flags (vLLM's names, `_` for `-`); restartable
    on the same port with other flags (`configure`, then start again)."""

    what = "sim"

    def __init__(
        self,
        port: int | None = None,
        *,
        workdir: Path | None = None,
        own_group: bool = False,
        startup_timeout_s: float = 30.0,
        **flags: object,
    ) -> None:
        self.flags: dict[str, object] = dict(flags)
        super().__init__(
            [],
            port=port or free_port(),
            workdir=workdir,
            startup_timeout_s=startup_timeout_s,
            own_group=own_group,
        )
        self._refresh_argv()

    def _refresh_argv(self) -> None:
        self.argv = [sys.executable, "-m", "gateway.sim", "--host", "127.0.0.1"]
        self.argv += ["--port", str(self.port), "--log-level", "warning", *_flags(self.flags)]

    def configure(self, **flags: object) -> SimProcess:
        """Change flags for the next start on the same port (stop or kill it first)."""
        self.flags.update(flags)
        self._refresh_argv()
        return self


class GatewayProcess(Child):
    """`kv-gateway serve` (the installed console script, as users run it) from a config
    mapping written as YAML; ready once `/ready` answers 200 (every model has an engine).
    `admin_key`: the plaintext of one of the config's `admin.api_keys`, for `status()`."""

    what = "gateway"

    def __init__(
        self,
        config: Mapping[str, Any],
        workdir: Path | None = None,
        *,
        port: int | None = None,
        args: Sequence[str] = (),
        log_level: str = "warning",
        startup_timeout_s: float = 60.0,
        own_group: bool = False,
        env: Mapping[str, str] | None = None,
        admin_key: str | None = None,
    ) -> None:
        port = port or free_port()
        self.admin_key = admin_key
        super().__init__(
            [],
            port=port,
            ready_path="/ready",
            workdir=workdir,
            startup_timeout_s=startup_timeout_s,
            own_group=own_group,
            env=env,
        )
        self.config = dict(config)
        self.config_path = self.workdir / f"gateway-{port}.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.argv = [*serve_command(), "--config", str(self.config_path), "--host", "127.0.0.1"]
        self.argv += ["--port", str(port), "--log-level", log_level, *args]

    def status(self) -> dict[str, Any]:
        """`/admin/status` (blocking)."""
        headers = {"authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}
        response = httpx.get(self.url + "/admin/status", headers=headers, timeout=10)
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body


def serve_command() -> list[str]:
    """`kv-gateway serve` as installed beside this interpreter, else through `-m`."""
    script = Path(sys.executable).with_name("kv-gateway")
    if script.exists():
        return [str(script), "serve"]
    return [sys.executable, "-m", "gateway.cli", "serve"]


class RedisServer:
    """A private `redis-server` (Debian's package) on a free port, keeping nothing on disk:
    for a test session on a machine without one, and for tests that stop and restart Redis.
    `args`: more of its command line (e.g. `--rename-command FCALL ""`, a server without
    functions, as before Redis 7.0)."""

    def __init__(self, port: int | None = None, args: Sequence[str] = ()) -> None:
        self.port = port or free_port()
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if shutil.which("redis-server") is None:
            raise StartError("redis-server is not installed (Debian: apt-get install redis-server)")
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no", *self.args]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StartError(f"redis-server on port {self.port} exited at start")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.02)
        self.stop()
        raise StartError(f"redis-server on port {self.port} did not answer in {timeout_s:g} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class CommandProcess(Child):
    """Any server started by a command (e.g. a real vLLM for `kv-gateway loadtest sweep`),
    in a process group of its own; `stop()` ends the whole group, since servers like vLLM
    leave worker processes behind their main one."""

    what = "engine"

    def __init__(
        self,
        argv: Sequence[str],
        *,
        port: int,
        ready_path: str = "/health",
        workdir: Path | None = None,
        startup_timeout_s: float = 300.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(
            argv,
            port=port,
            ready_path=ready_path,
            workdir=workdir,
            startup_timeout_s=startup_timeout_s,
            own_group=True,
            env=env,
        )

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        pid = self.pid
        super().stop(grace_s)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    def kill(self) -> None:
        pid = self.pid
        super().kill()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
