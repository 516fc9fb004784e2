"""Never worse than going direct, on the real engine: below saturation the gateway in front of
vLLM carries the engine's throughput (issue 12 asks at least 0.95x).

On 2 cores the engine's OpenMP threads share the CPU with the load generator and the gateway,
and back-to-back runs' rates swing by ±25 % (five runs of sequential rounds on 2026-12-01/02
gave overall ratios 0.82, 0.87, 0.94, 0.96 and 1.09): a 5 % difference cannot be told from
noise between runs. So the comparison is made within one run: `kv-gateway loadtest compare
--order mixed` sends the requests of one closed loop to the engine directly, through the
gateway, and through a bare TCP relay (tests/e2e/relay.py) in turn, so that all three share
the engine, its batch and the machine at the same moments. In a closed loop throughput is
concurrency over the mean request time, so a throughput ratio is a ratio of mean request
times.

The relay is the control: on this machine every process in the path competes with the
engine for the two cores, and a hop that does nothing already costs requests time (2026-12-02,
mixed runs: 1-25 % depending on the machine's other load). What the gateway must not add is
cost of its own: the test asserts that it carries at least 0.95x of what the bare relay
carries (this failed before the metrics-page fix: prometheus_client's parser stalled the
gateway's loop for 26 ms+ per probe), and a 0.75x floor against direct, and prints both.
The 0.95x-of-direct target itself is judged on simulated engines (docs/benchmarks.md), where
the engine does not take the client's and the gateway's cores.

Two clients, each request two 128-token blocks (40 prompt + 100 output tokens) of the
engine's 5 usable: nothing ever waits in the gateway's line (the other targets' requests are
foreign load to it, and two requests never fill the engine), so whatever the gateway costs a
request shows in the ratio.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.harness import CommandProcess, free_port
from tests.e2e import conftest
from tests.e2e.gateway_process import GatewayProcess

pytestmark = pytest.mark.vllm

REQUESTS = 90  # all three kinds together; 3 warm-up requests first
OF_RELAY = 0.95  # the gateway carries at least this share of what a bare hop carries
FLOOR = 0.75  # against direct: a real regression (requests serialised, held back) breaks it


@pytest.fixture
def relay(vllm_url: str, tmp_path: Path) -> Iterator[str]:
    host, port = vllm_url.removeprefix("http://").rsplit(":", 1)
    listen = free_port()
    process = CommandProcess(
        [sys.executable, "-m", "tests.e2e.relay", host, port, str(listen)],
        port=listen,
        workdir=tmp_path,
        startup_timeout_s=30,
    )
    process.start()
    try:
        yield f"http://127.0.0.1:{listen}"
    finally:
        process.stop()


def test_below_saturation_the_gateway_keeps_the_engines_throughput(
    vllm_url: str, gateway: GatewayProcess, relay: str, vllm_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "mixed.json"
    code = main(
        [
            "loadtest", "compare",
            "--target", f"direct={vllm_url}", "--target", f"gateway={gateway.url}",
            "--target", f"relay={relay}", "--order", "mixed",
            "--tokenizer", f"hf:{vllm_model_dir}", "--api", "completions",
            "--concurrency", "2", "--requests", str(REQUESTS), "--warmup", "3",
            "--input-len", "40", "--output-len", "100",
            "--timeout", "120", "--json", str(out), "--quiet",
        ]
    )  # fmt: skip
    assert code == 0, out
    runs = {r["target"]["name"]: r for r in json.loads(out.read_text())["runs"]}
    for run in runs.values():
        assert run["summary"]["success_rate"] == 1.0, run["summary"]["failures"]
        assert run["summary"]["requests"] >= REQUESTS // 3 - 3
        assert {r["target"] for r in run["records"]} == {run["target"]["name"]}
    mean = {t: runs[t]["summary"]["latency_ms"]["e2e"]["mean"] for t in runs}
    of_direct, of_relay = mean["direct"] / mean["gateway"], mean["relay"] / mean["gateway"]
    conftest.record_figure(
        "below saturation, mixed run: mean request ms direct / relay / gateway",
        f"{mean['direct']:.0f} / {mean['relay']:.0f} / {mean['gateway']:.0f}; gateway "
        f"throughput {of_direct:.3f}x direct, {of_relay:.3f}x a bare relay",
    )
    assert of_relay >= OF_RELAY, (mean, gateway.log_tail())
    assert of_direct >= FLOOR, (mean, gateway.log_tail())
