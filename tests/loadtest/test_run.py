"""`kv-gateway loadtest run` over real HTTP against a simulated engine, the gateway and
scripted servers: arrivals, exact token counts, trace replay, retries, the JSON report."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path
from typing import Any

import pytest

from gateway.harness import GatewayProcess, SimProcess
from gateway.loadtest.aggregate import parse_slo, summarize
from gateway.loadtest.records import from_dict
from tests.loadtest.conftest import run_tool
from tests.loadtest.scripted import Scripted

SMALL = ["--api", "completions", "--input-len", "20", "--output-len", "2"]


def sends(report: dict[str, Any]) -> list[float]:
    return sorted(r["sent_s"] for r in report["records"])


@pytest.mark.parametrize(("burstiness", "cv_low", "cv_high"), [("1", 0.55, 1.5), ("inf", 0.0, 0.4)])
def test_open_loop_keeps_its_rate(
    sim: SimProcess,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    burstiness: str,
    cv_low: float,
    cv_high: float,
) -> None:
    n, rate = 150, 40.0
    code, report, err = run_tool(
        capsys, tmp_path, "run", "--target", sim.url, *SMALL,
        "--rate", str(rate), "--burstiness", burstiness, "--requests", str(n),
    )  # fmt: skip
    assert code == 0, err
    assert report["summary"]["outcomes"]["ok"] == n
    times = sends(report)
    # n Poisson arrivals estimate the rate within ±1/sqrt(n) (8 %) per sd: ±35 % is > 4 sd.
    assert (n - 1) / (times[-1] - times[0]) == pytest.approx(rate, rel=0.35)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert cv_low <= statistics.pstdev(gaps) / statistics.fmean(gaps) <= cv_high


def test_closed_loop_holds_its_concurrency(
    sim: SimProcess, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, report, _ = run_tool(
        capsys, tmp_path, "run", "--target", sim.url, "--concurrency", "3",
        "--requests", "24", "--output-len", "8",
    )  # fmt: skip
    assert code == 0 and report["summary"]["outcomes"]["ok"] == 24
    records = report["records"]
    for r in records:  # never more than 3 in flight at any send
        in_flight = sum(1 for o in records if o["sent_s"] <= r["sent_s"] < o["done_s"])
        assert in_flight <= 3


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_shared_prefixes_and_sessions_have_exact_token_counts(
    sim: SimProcess, capsys: pytest.CaptureFixture[str], tmp_path: Path, api: str
) -> None:
    code, report, _ = run_tool(
        capsys, tmp_path, "run", "--target", sim.url, "--api", api, "--concurrency", "4",
        "--requests", "24", "--prefix-groups", "3", "--prefix-tokens", "48",
        "--input-len", "uniform:60,300", "--output-len", "uniform:3,9", "--turns", "3",
    )  # fmt: skip
    assert code == 0
    records = report["records"]
    assert all(r["outcome"] == "ok" for r in records)
    assert all(r["prompt_tokens"] == r["input_tokens"] for r in records)  # the engine's usage
    assert all(r["output_tokens"] == r["max_tokens"] for r in records)  # ignore_eos
    assert {r["prefix_group"] for r in records if r["turn"] == 1} <= {0, 1, 2}
    sessions: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        sessions.setdefault(r["session"], []).append(r)
    full = [s for s in sessions.values() if len(s) == 3]
    assert full, "no session ran its three turns"
    for turns in full:
        turns.sort(key=lambda r: r["turn"])
        for before, after in itertools.pairwise(turns):
            # Each turn re-sends the conversation: the last prompt, the answer, a new message.
            assert after["prompt_tokens"] > before["prompt_tokens"] + before["output_tokens"]


def test_later_turns_add_turn_input_len(
    sim: SimProcess, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A first turn of --input-len (a long system prompt and a question), later turns that
    add --turn-input-len after the previous answer."""
    code, report, _ = run_tool(
        capsys, tmp_path, "run", "--target", sim.url, "--concurrency", "2", "--requests", "6",
        "--prefix-groups", "1", "--prefix-tokens", "96", "--input-len", "150",
        "--turn-input-len", "12", "--output-len", "4", "--turns", "3",
    )  # fmt: skip
    assert code == 0
    records = report["records"]
    assert all(r["outcome"] == "ok" and r["prompt_tokens"] == r["input_tokens"] for r in records)
    assert {r["input_tokens"] for r in records if r["turn"] == 1} == {150}
    sessions: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        sessions.setdefault(r["session"], []).append(r)
    assert [len(s) for s in sessions.values()] == [3, 3]
    for turns in sessions.values():
        turns.sort(key=lambda r: r["turn"])
        for before, after in itertools.pairwise(turns):
            # The answer re-rendered (and its end of turn), then the 12 new tokens.
            added = after["prompt_tokens"] - before["prompt_tokens"] - before["output_tokens"]
            assert 12 <= added <= 12 + 4


def test_a_trace_is_replayed_on_its_timestamps(
    sim: SimProcess, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "trace.csv"
    stamps = [0, 100, 300, 600, 1000, 1500, 1600, 2400]
    lines = [f"{t},{40 + i * 10},{3 + i}" for i, t in enumerate(stamps)]
    trace.write_text("timestamp,input_tokens,output_tokens\n" + "\n".join(lines) + "\n")
    code, report, _ = run_tool(
        capsys, tmp_path, "run", "--target", sim.url, "--api", "completions",
        "--trace", str(trace), "--time-scale", "0.5",
    )  # fmt: skip
    assert code == 0
    records = sorted(report["records"], key=lambda r: r["scheduled_s"])
    assert [r["scheduled_s"] for r in records] == [t / 1000 * 0.5 for t in stamps]
    # Sent on the trace's timestamps, up to one common lag (a busy machine may start the first
    # send late; measuring from it alone made one late send shift every other).
    lags = sorted(r["sent_s"] - r["scheduled_s"] for r in records)
    lag = lags[len(lags) // 2]
    for r in records:
        assert r["sent_s"] - lag == pytest.approx(r["scheduled_s"], abs=0.08), (r, lag)
    assert [r["prompt_tokens"] for r in records] == [40 + i * 10 for i in range(len(stamps))]
    assert [r["output_tokens"] for r in records] == [3 + i for i in range(len(stamps))]


@pytest.mark.parametrize(
    ("headers", "advised"),
    [({"retry-after-ms": "300"}, 0.3), ({"retry-after": "1"}, 1.0)],
)
def test_retries_follow_retry_after(
    serve: Any,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    headers: dict[str, str],
    advised: float,
) -> None:
    server = Scripted(lambda attempt: (429, headers) if attempt == 1 else None)
    url = serve(server.app)
    code, report, _ = run_tool(
        capsys, tmp_path, "run", "--target", url, "--concurrency", "2", "--requests", "4",
        "--input-len", "30", "--retry-429", "3",
    )  # fmt: skip
    assert code == 0
    for times in server.arrivals.values():
        assert len(times) == 2
        assert advised - 0.01 <= times[1] - times[0] <= advised + 0.3
    r = report["summary"]["retries"]
    assert (r["first_try_refused"], r["retries"], r["retried_then_ok"]) == (4, 4, 4)
    assert r["admitted_at_first_retry"] == 1.0
    assert r["advised_ms"]["p50"] == pytest.approx(advised * 1000)
    assert r["advice_gap_ms"]["max"] < 300
    for record in report["records"]:
        assert record["attempts"][0]["waited_s"] == pytest.approx(advised)


def test_retries_stop_at_the_limit(
    serve: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    server = Scripted(lambda attempt: (429, {"retry-after-ms": "50"}))
    code, report, err = run_tool(
        capsys, tmp_path, "run", "--target", serve(server.app), "--concurrency", "1",
        "--requests", "2", "--input-len", "30", "--retry-429", "2",
    )  # fmt: skip
    assert code == 1 and "no request succeeded" in err and "refused:429:queue_full ×2" in err
    assert [len(t) for t in server.arrivals.values()] == [3, 3]
    assert report["summary"]["outcomes"]["refused"] == 2


def test_the_json_recomputes_from_its_records(
    sim: SimProcess, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    slo = "ttft=50ms,tpot=20ms"
    code, report, _ = run_tool(
        capsys, tmp_path, "run", "--target", sim.url, "--rate", "50", "--requests", "40",
        "--warmup", "5", "--input-len", "uniform:20,80", "--output-len", "uniform:2,12",
        "--slo", slo,
    )  # fmt: skip
    assert code == 0
    records = [from_dict(r) for r in report["records"]]
    assert len(records) == 40 and sum(r.warmup for r in records) == 5
    assert summarize(records, parse_slo(slo)) == report["summary"]
    assert report["summary"]["requests"] == 35
    engine = report["metrics"]["summary"]
    assert engine["num_gpu_blocks"] == {report["target"]["urls"][0]: 512}


def test_through_the_gateway(
    gateway: GatewayProcess, sim: SimProcess, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, report, _ = run_tool(
        capsys, tmp_path, "run", "--target", f"gw={gateway.url}", "--rate", "inf",
        "--requests", "30", "--output-len", "40", "--retry-429", "0",
    )  # fmt: skip
    assert code == 0
    assert report["target"]["kind"] == "gateway"
    assert report["target"]["engine_metrics"] == [sim.url]  # found through /admin/status
    s, m = report["summary"], report["metrics"]["summary"]
    refused = s["outcomes"]["refused"]
    assert refused > 0 and s["outcomes"]["ok"] == 30 - refused
    assert s["retries"]["first_try_refused"] == refused and s["retries"]["retries"] == 0
    assert m["gateway_answers"].get("queue_full", 0) == refused
    assert m["peak_running"] <= 4


def test_tenants_send_their_own_keys_and_loads(
    serve: Any,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = Scripted(lambda attempt: None)
    monkeypatch.setenv("KEY_A", "sk-a")
    (tmp_path / "b.key").write_text("sk-b\n")
    workload = tmp_path / "tenants.yaml"
    workload.write_text(
        "tenants:\n"
        "  - {name: a, api_key_env: KEY_A, concurrency: 2, input_len: 40}\n"
        f"  - {{name: b, api_key_file: {tmp_path / 'b.key'}, rate: 1000, input_len: 60}}\n"
    )
    # b at 1,000 a second: its first arrival is due within ~1 ms, before a's closed loop of
    # 2 can take all 40 requests (at 50 a second it sometimes took all 20 first: flaky).
    code, report, _ = run_tool(
        capsys, tmp_path, "run", "--target", serve(server.app), "--workload", str(workload),
        "--requests", "40",
    )  # fmt: skip
    assert code == 0
    by_tenant = {r["tenant"]: r for r in report["records"]}
    assert set(by_tenant) == {"a", "b"}
    assert set(server.keys) == {"Bearer sk-a", "Bearer sk-b"}
    assert {r["input_tokens"] for r in report["records"] if r["tenant"] == "b"} == {60}
    assert set(report["summary"]["per_tenant"]) == {"a", "b"}
    assert sum(t["requests"] for t in report["summary"]["per_tenant"].values()) == 40
