"""Deployments the tool starts itself for `compare` and `sweep`, through `gateway.harness`:
simulated engines (restarted before each run, so every run starts from a clean engine), a
`kv-gateway serve` in front of them, or any engine started by a command template.

Contract: `start()` returns once every server answers; `stop()` leaves no process behind and
may be called twice. A server that does not start raises `SetupError` with one line (the
server's log stays in its work directory, named in the message).
"""

from __future__ import annotations

import asyncio
import copy
import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.harness import CommandProcess, GatewayProcess, SimProcess, StartError, free_port

DEFAULT_SIM_SEQS = 64  # the simulator's --max-num-seqs default


class SetupError(RuntimeError):
    """A server of the setup did not start; one line."""


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` deep-merged into a copy of `base` (mappings merge, anything else replaces)."""
    out = copy.deepcopy(dict(base))
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def set_dotted(config: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A copy of `config` with `a.b.c` set to `value`."""
    *path, last = dotted.split(".")
    over: dict[str, Any] = {last: value}
    for key in reversed(path):
        over = {key: over}
    return merge(config, over)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


class SimFleet:
    """`count` simulated engines with the same flags (vLLM's names, `_` for `-`)."""

    def __init__(self, count: int, flags: Mapping[str, Any], workdir: Path | None = None):
        if count < 1:
            raise ValueError("engines.count must be at least 1")
        self.flags = dict(flags)
        self.procs = [
            SimProcess(workdir=workdir, own_group=True, **{**self.flags, "seed": i})
            for i in range(count)
        ]

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.procs]

    @property
    def model(self) -> str:
        return str(self.flags.get("served_model_name", "tiny"))

    async def start(self) -> None:
        try:
            for proc in self.procs:
                await proc.astart()
        except StartError as exc:
            await self.stop()
            raise SetupError(f"simulated engine did not start: {_last_line(exc)}") from None

    async def restart(self, **flags: Any) -> None:
        """Stop, change flags, start again on the same ports (a clean engine)."""
        await self.stop()
        self.flags.update(flags)
        for proc in self.procs:
            proc.configure(**flags)
        await self.start()

    async def stop(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in self.procs))

    def gateway_engines(self) -> list[dict[str, Any]]:
        seqs = int(self.flags.get("max_num_seqs", DEFAULT_SIM_SEQS))
        return [
            {"name": f"e{i}", "url": url, "max_num_seqs": seqs} for i, url in enumerate(self.urls)
        ]


class CommandEngine:
    """One engine started by a command template: `{value}` and `{port}` (a free port) are
    substituted, then the command is split like a shell would (no shell runs it). `env`
    adds variables to the server's environment (None removes one)."""

    def __init__(
        self,
        template: str,
        *,
        url_template: str = "http://127.0.0.1:{port}",
        env: Mapping[str, str | None] | None = None,
        startup_timeout_s: float = 300.0,
        workdir: Path | None = None,
    ) -> None:
        self.template = template
        self.url_template = url_template
        self.env = dict(env) if env else None
        self.startup_timeout_s = startup_timeout_s
        self.workdir = workdir
        self.proc: CommandProcess | None = None
        self.url = ""

    async def start(self, **fields: Any) -> None:
        port = free_port()
        values = {**fields, "port": port}
        try:
            argv = shlex.split(self.template.format(**values))
            self.url = self.url_template.format(**values).rstrip("/")
        except (KeyError, IndexError, ValueError) as exc:
            raise SetupError(f"command template: cannot fill {exc}") from None
        env = None
        if self.env is not None:
            # The server's environment: ours, with the spec's variables set (None: unset).
            env = {**os.environ, **{k: v for k, v in self.env.items() if v is not None}}
            for key in [k for k, v in self.env.items() if v is None]:
                env.pop(key, None)
        self.proc = CommandProcess(
            argv,
            port=port,
            env=env,
            startup_timeout_s=self.startup_timeout_s,
            workdir=self.workdir,
        )
        try:
            await self.proc.astart()
        except (StartError, OSError) as exc:
            raise SetupError(f"engine command did not start: {_last_line(exc)}") from None

    async def stop(self) -> None:
        if self.proc is not None:
            await asyncio.to_thread(self.proc.stop)
            self.proc = None


class ManagedGateway:
    """A `kv-gateway serve` in front of given engines; a fresh process per `start()`."""

    def __init__(self, workdir: Path | None = None) -> None:
        self.workdir = workdir
        self.proc: GatewayProcess | None = None

    @staticmethod
    def config(
        engines: list[dict[str, Any]],
        model: str,
        tokenizer: str,
        overrides: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        base: dict[str, Any] = {
            "engines": engines,
            "models": [{"name": model, "tokenizer": tokenizer}],
        }
        return merge(base, overrides or {})

    async def start(self, config: Mapping[str, Any]) -> str:
        self.proc = GatewayProcess(config, self.workdir, own_group=True)
        try:
            await self.proc.astart()
        except StartError as exc:
            raise SetupError(f"gateway did not start: {_last_line(exc)}") from None
        return self.proc.url

    async def stop(self) -> None:
        if self.proc is not None:
            await asyncio.to_thread(self.proc.stop)
            self.proc = None


def _last_line(exc: BaseException) -> str:
    """The first line of the error and the last line of the server's log."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1:
        return f"{lines[0]} — {lines[-1].strip()}"
    return _first_line(exc)
