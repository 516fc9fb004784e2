"""The command's edges: bad input is one line and exit 2, a failing target exit 1, Ctrl-C
writes what was measured; compare and sweep end to end on simulated engines."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.harness import SimProcess, free_port
from tests.loadtest.conftest import run_tool
from tests.loadtest.scripted import Scripted

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target", "http://127.0.0.1:{port}", "--requests", "2"], "cannot reach"),
        (["--target", "nowhere", "--requests", "2"], "is not an http(s) URL"),
        (["--target", "{sim}", "--trace", "/no/trace.csv"], "cannot read trace /no/trace.csv"),
        (["--target", "{sim}", "--requests", "2", "--slo", "ttft=soon"], "--slo"),
        (["--target", "{sim}", "--requests", "2", "--slo", "speed=1ms"], "--slo"),
        (["--target", "{sim}", "--requests", "2", "--input-len", "zipf:2"], "unknown distribution"),
        (["--target", "{sim}", "--rate", "5"], "bound the run"),
        (["--target", "{sim}", "--requests", "2", "--rate", "1", "--concurrency", "2"], "one of"),
        (["--target", "{sim}", "--requests", "2", "--tokenizer", "estimate"], "hf:<dir>"),
        (["--target", "{sim}", "--requests", "2", "--api-key-env", "NO_SUCH_VAR_9"], "not set"),
        (["--target", "{sim}", "--requests", "2", "--model", "gpt-9"], "does not serve model"),
        (["--target", "{sim}", "--requests", "2", "--input-len", "5"], "shorter than"),
        (["--target", "{sim}", "--requests", "2", "--turn-input-len", "8"], "give --turns"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    sim: SimProcess,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    argv: list[str],
    message: str,
) -> None:
    argv = [a.format(port=free_port(), sim=sim.url) for a in argv]
    code, report, err = run_tool(capsys, tmp_path, "run", *argv)
    assert code == 2 and report == {}
    assert err.count("\n") == 1 and err.startswith("kv-gateway loadtest: error:")
    assert message in err and "Traceback" not in err


def test_a_target_that_answers_errors_exits_1(
    serve: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    server = Scripted(lambda attempt: (500, {}))
    code, report, err = run_tool(
        capsys, tmp_path, "run", "--target", serve(server.app), "--requests", "3",
        "--input-len", "30",
    )  # fmt: skip
    assert code == 1 and err.count("\n") == 1
    assert "no request succeeded" in err and "error:500:queue_full ×3" in err
    assert report["summary"]["outcomes"]["error"] == 3  # the report is still written


def test_plots_without_matplotlib_name_the_extra(
    sim: SimProcess, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    code, _, err = run_tool(
        capsys, tmp_path, "run", "--target", sim.url, "--requests", "1", "--plots", "out"
    )
    assert code == 2 and "pip install 'kv-gateway[loadtest]'" in err


def test_ctrl_c_writes_what_was_measured(sim: SimProcess, tmp_path: Path) -> None:
    out = tmp_path / "partial.json"
    argv = [sys.executable, "-m", "gateway.cli", "loadtest", "run", "--target", sim.url]
    argv += ["--rate", "20", "--duration", "120", "--output-len", "200", "--json", str(out)]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(4)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr.decode()
    assert b"Traceback" not in stderr and b"interrupted" in stdout
    report = json.loads(out.read_text())
    assert report["interrupted"] is True
    outcomes = report["summary"]["outcomes"]
    assert outcomes["ok"] > 0 and outcomes["cancelled"] > 0  # in flight at the stop
    assert outcomes["ok"] + outcomes["cancelled"] == len(report["records"])


def test_compare_direct_and_gateway(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = tmp_path / "compare.yaml"
    spec.write_text(
        json.dumps(
            {
                "engines": {"count": 2, "flags": {"num_gpu_blocks": 64, "max_model_len": 512}},
                "targets": [
                    {"name": "direct", "direct": True},
                    {"name": "gw", "gateway": {"admission": {"kv_ceiling": 0.9}}},
                ],
                "rates": ["0.5x", "2x"],
                "capacity_requests": 20,
            }
        )
    )
    code, report, _ = run_tool(
        capsys, tmp_path, "compare", "--spec", str(spec), "--requests", "12",
        "--output-len", "16", "--input-len", "40", "--plots", str(tmp_path / "img"),
    )  # fmt: skip
    assert code == 0
    capacity = report["capacity"]["requests_per_s"]
    assert capacity > 0 and report["capacity_run"]["summary"]["requests"] == 20
    runs = report["runs"]
    assert [r["label"] for r in runs] == ["direct @ 0.5x", "gw @ 0.5x", "gw @ 2x", "direct @ 2x"]
    assert [r["rate"] for r in runs] == [pytest.approx(capacity * k) for k in (0.5, 0.5, 2, 2)]
    assert [r["target"]["kind"] for r in runs] == ["engine", "gateway", "gateway", "engine"]
    assert all(
        len(r["target"]["urls"]) == (2 if r["target"]["kind"] == "engine" else 1) for r in runs
    )
    assert all(r["summary"]["outcomes"]["ok"] == 12 for r in runs)
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == [
        "compare-0.5x-latency-cdf.png",
        "compare-0.5x-over-time.png",
        "compare-2x-latency-cdf.png",
        "compare-2x-over-time.png",
    ]


def test_compare_at_the_slo_capacity(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = tmp_path / "compare.yaml"
    spec.write_text(
        json.dumps(
            {
                "engines": {"count": 1, "flags": {"num_gpu_blocks": 64, "max_model_len": 512}},
                "targets": [{"name": "direct", "direct": True}],
                "rates": ["1x"],
                "capacity": "slo",
                "capacity_requests": 10,
                "capacity_probes": 2,
            }
        )
    )
    code, report, _ = run_tool(
        capsys, tmp_path, "compare", "--spec", str(spec), "--requests", "6", "--slo", "e2e=60s",
        "--output-len", "16", "--input-len", "loguniform:20,80",
    )  # fmt: skip
    assert code == 0
    throughput = report["capacity"]["requests_per_s"]
    found = report["slo_capacity"]
    # Every probe meets a loose SLO: half the throughput capacity, then three quarters.
    assert [p["rate"] for p in found["probes"]] == [
        pytest.approx(throughput * 0.5, rel=1e-3), pytest.approx(throughput * 0.75, rel=1e-3)
    ]  # fmt: skip
    assert all(p["passed"] and p["met"] == 1.0 for p in found["probes"])
    assert found["requests_per_s"] == pytest.approx(0.75 * throughput)
    assert [p["label"] for p in report["capacity_probes"]] == [
        "direct @ slo-probe-1", "direct @ slo-probe-2"
    ]  # fmt: skip
    assert all(p["summary"]["requests"] == 10 for p in report["capacity_probes"])
    assert [r["rate"] for r in report["runs"]] == [pytest.approx(0.75 * throughput)]


def test_compare_mixed_sends_the_same_load_to_each_target_at_once(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = tmp_path / "compare.yaml"
    spec.write_text(
        json.dumps(
            {
                "engines": {"count": 1, "flags": {"num_gpu_blocks": 64, "max_model_len": 512}},
                "targets": [{"name": "direct", "direct": True}, {"name": "gw", "gateway": {}}],
                "rates": ["1x"],
                "order": "mixed",
                "capacity_requests": 10,
            }
        )
    )
    code, report, _ = run_tool(
        capsys, tmp_path, "compare", "--spec", str(spec), "--requests", "24",
        "--output-len", "16", "--input-len", "40",
    )  # fmt: skip
    assert code == 0
    runs = report["runs"]
    assert [r["label"] for r in runs] == ["direct @ 1x", "gw @ 1x"]
    assert [r["target"]["kind"] for r in runs] == ["engine", "gateway"]
    assert [r["mixed_with"] for r in runs] == [["gw"], ["direct"]]
    # One run, the requests in turn: each target has half of them, all its own, answered.
    for run, name in zip(runs, ("direct", "gw"), strict=True):
        assert run["summary"]["outcomes"]["ok"] == 12
        assert {r["target"] for r in run["records"]} == {name}
    indices = sorted((r["index"], r["target"]) for run in runs for r in run["records"])
    assert [i for i, _ in indices] == list(range(24))
    # At the same moments: the two targets' requests span the same stretch of time.
    spans = [(min(r["sent_s"] for r in x["records"]), max(r["done_s"] for r in x["records"]))
             for x in runs]  # fmt: skip
    assert abs(spans[0][0] - spans[1][0]) < 1.0 and abs(spans[0][1] - spans[1][1]) < 2.0


def test_compare_mixed_needs_two_targets(
    sim: SimProcess, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = run_tool(
        capsys, tmp_path, "compare", "--target", sim.url, "--order", "mixed", "--requests", "2"
    )
    assert code == 2 and "order mixed needs at least two targets" in err


def test_sweep_gpu_memory_utilization_on_planned_engines(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = tmp_path / "sweep.yaml"
    spec.write_text(
        json.dumps(
            {
                "parameter": "gpu_memory_utilization",
                "values": [0.5, 0.72, 0.9],
                "planner": {"model": "llama-3.1-8b", "gpu": "l4", "max-model-len": 2048},
                "engine": {"flags": {"decode_ms_base": 1.0, "decode_ms_per_seq": 0.05}},
            }
        )
    )
    code, report, _ = run_tool(
        capsys, tmp_path, "sweep", "--spec", str(spec), "--concurrency", "12",
        "--requests", "12", "--input-len", "600", "--output-len", "400",
    )  # fmt: skip
    assert code == 0
    rows = report["rows"]
    assert rows[0]["skipped"].startswith("vLLM would not start")  # weights above the budget
    small, large = rows[1], rows[2]
    assert small["planned_blocks"] == small["reported_blocks"] < large["planned_blocks"]
    assert large["planned_blocks"] == large["reported_blocks"]
    # 12 requests growing to 1000 tokens need 756 blocks: 229 usable preempt, 2441 do not.
    assert small["preemptions"] > 0 and large["preemptions"] == 0
    assert small["ttft_mean_ms"] > large["ttft_mean_ms"]
    assert report["recommendation"]["value"] == 0.9
    assert report["recommendation"]["text"].startswith(
        "recommendation: gpu_memory_utilization = 0.9"
    )
