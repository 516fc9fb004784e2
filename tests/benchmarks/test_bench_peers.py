"""benchmarks/bench_peers.py: its answers and requests are what the contenders expect, and a
short run of the contenders that need nothing installed (direct and kv-gateway, on the
script's own upstream and load generator) reports every figure. With nginx and wrk present,
a run on them too."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gateway.engines.metrics import parse_page

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_peers.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_peers", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = load_script()


@pytest.mark.parametrize("stream", [False, True])
def test_each_request_is_a_different_chat_of_about_a_kilobyte(stream: bool) -> None:
    head, tail = bench.request_parts(stream)
    bodies = [json.loads(head + str(n).encode() + tail) for n in (7, 10**7 + 1)]
    assert bodies[0] != bodies[1]
    assert bodies[0]["messages"][1]["content"].startswith("Ticket 7:")
    assert bodies[0].get("stream", False) is stream
    assert 900 <= len(head + b"7" + tail) <= 1300


@pytest.mark.parametrize("stream", [0, 50])
def test_the_upstream_answers_as_vllm_does(stream: int) -> None:
    answers = bench.answers(stream)
    assert set(answers) == {"/health", "/v1/models", "/metrics", "/v1/chat/completions"}
    page = parse_page(answers["/metrics"][1].decode())
    assert page.cache is not None
    assert page.cache.num_gpu_blocks == bench.ENGINE["num_gpu_blocks"]
    assert json.loads(answers["/v1/models"][1])["data"][0]["id"] == bench.MODEL
    content_type, chat = answers["/v1/chat/completions"]
    if not stream:
        assert content_type == "application/json"
        assert json.loads(chat)["usage"]["completion_tokens"] == bench.MAX_TOKENS
        return
    assert content_type == "text/event-stream"
    events = [e.removeprefix(b"data: ") for e in chat.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert sum(1 for c in chunks if c["choices"] and "content" in c["choices"][0]["delta"]) == 51
    assert chunks[-1]["usage"]["completion_tokens"] == stream
    assert bench.nginx_locations(stream).count("location = ") == 4  # no body refused


def test_a_template_with_a_field_left_unfilled_is_refused() -> None:
    with pytest.raises(ValueError, match="UPSTREAM_PORT"):
        bench.render("envoy.yaml", PORT=1)


def run_script(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "peers.json"
    argv = [sys.executable, str(SCRIPT), "--rounds", "1", "--seconds", "1", "--warmup-s", "0.5"]
    done = subprocess.run(
        [*argv, "--json", str(out), "--max-runtime-s", "240", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def assert_figures(report: dict[str, Any], contenders: list[str], levels: list[int]) -> None:
    assert report["skipped"] == {}
    assert list(report["summary"]) == contenders
    assert len(report["windows"]) == len(contenders) * len(levels)
    for name in contenders:
        for level in levels:
            figures = report["summary"][name][f"c{level}"]
            assert figures["errors"] == 0, (name, level, figures)
            assert figures["rps"] > 0
            assert 0 < figures["p50_ms"] <= figures["p99_ms"]
            assert figures["cpu_us_per_request"] > 0
    gateway = report["summary"]["kv-gateway"][f"c{levels[0]}"]["cpu_us_by_part"]
    assert set(gateway) == {"kv-gateway", "upstream", "load"}
    assert report["ratios"]["added_p50_ms_c1_kv-gateway"] > 0
    assert report["ratios"][f"p99_c{levels[0]}_kv-gateway_over_direct"] > 0


def test_a_short_run_without_peers_reports_every_figure(tmp_path: Path) -> None:
    report = run_script(
        tmp_path, "--only", "direct,kv-gateway", "--levels", "8,1",
        "--upstream", "python", "--load", "python",
    )  # fmt: skip
    assert report["load_generator"].startswith("python")
    assert_figures(report, ["direct", "kv-gateway"], [8, 1])


@pytest.mark.skipif(
    shutil.which("wrk") is None or shutil.which("nginx", path="/usr/sbin:/usr/bin") is None,
    reason="nginx and wrk not installed (Debian: apt-get install nginx wrk)",
)
def test_a_short_run_on_nginx_and_wrk(tmp_path: Path) -> None:
    report = run_script(
        tmp_path, "--only", "direct,nginx,kv-gateway", "--levels", "8,1",
        "--upstream", "nginx", "--load", "wrk",
    )  # fmt: skip
    assert report["upstream"].startswith("nginx")
    assert_figures(report, ["direct", "nginx", "kv-gateway"], [8, 1])
    assert report["ratios"]["cpu_kv-gateway_over_nginx_c8"]["ratio"] > 1
