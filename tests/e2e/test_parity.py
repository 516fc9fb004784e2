"""Never worse than going direct, on the real engine: below saturation the gateway in front of
vLLM carries the engine's throughput (issue 12 asks at least 0.95x).

On 2 cores the engine's OpenMP threads share the CPU with the load generator and the gateway,
and back-to-back runs' rates swing by ±25 % (five runs of sequential rounds on 2026-12-01/02
gave overall ratios 0.82, 0.87, 0.94, 0.96 and 1.09): a 5 % difference cannot be told from
noise between runs. So the comparison is made within one run: `kv-gateway loadtest compare
--order mixed` sends the requests of one closed loop to the engine directly and through the
gateway in turn, so that both kinds share the engine, its batch and the machine at the same
moments and the drift falls on both alike. In a closed loop throughput is concurrency over
the mean request time, so the throughput ratio is the ratio of the mean whole-request times.

Two clients, each request one 128-token block (40 prompt + 100 output tokens) of the
engine's 5 usable: nothing ever waits in the gateway's line (the direct requests are foreign
load to it, and both kinds together never fill the engine), so whatever the gateway costs a
request shows in the ratio.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from tests.e2e import conftest
from tests.e2e.gateway_process import GatewayProcess

pytestmark = pytest.mark.vllm

REQUESTS = 60  # both kinds together; 2 warm-up requests first
TARGET = 0.95


def test_below_saturation_the_gateway_keeps_the_engines_throughput(
    vllm_url: str, gateway: GatewayProcess, vllm_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "mixed.json"
    code = main(
        [
            "loadtest", "compare",
            "--target", f"direct={vllm_url}", "--target", f"gateway={gateway.url}",
            "--order", "mixed",
            "--tokenizer", f"hf:{vllm_model_dir}", "--api", "completions",
            "--concurrency", "2", "--requests", str(REQUESTS), "--warmup", "2",
            "--input-len", "40", "--output-len", "100",
            "--timeout", "120", "--json", str(out), "--quiet",
        ]
    )  # fmt: skip
    assert code == 0, out
    runs = {r["target"]["name"]: r for r in json.loads(out.read_text())["runs"]}
    for run in runs.values():
        assert run["summary"]["success_rate"] == 1.0, run["summary"]["failures"]
        assert run["summary"]["requests"] >= REQUESTS // 2 - 2
        assert {r["target"] for r in run["records"]} == {run["target"]["name"]}
    direct, through = (runs[t]["summary"]["latency_ms"]["e2e"] for t in ("direct", "gateway"))
    ratio = direct["mean"] / through["mean"]
    conftest.record_figure(
        "below saturation, mixed run: request time direct / through the gateway (mean, p50 ms)",
        f"{direct['mean']:.0f} / {through['mean']:.0f}, {direct['p50']:.0f} / "
        f"{through['p50']:.0f}; throughput ratio {ratio:.3f}",
    )
    assert ratio >= TARGET, (direct, through, gateway.log_tail())
