"""What compare prints: TTFT p99 of the admitted, 429s by code with their latency, and the
SLO capacity search."""

from __future__ import annotations

import io
from typing import Any

from gateway.loadtest import report
from gateway.loadtest.aggregate import summarize
from gateway.loadtest.capacity import SloSearch
from gateway.loadtest.records import Attempt, RequestRecord


def record(i: int, status: int = 200, code: str | None = None, ttft: float = 0.1) -> RequestRecord:
    ok = status == 200
    return RequestRecord(
        index=i,
        tenant="t",
        api="completions",
        stream=True,
        input_tokens=10,
        max_tokens=5,
        outcome="ok" if ok else "refused",
        status=status,
        sent_s=float(i),
        done_s=float(i) + 1,
        reason=code,
        output_tokens=5 if ok else None,
        ttft_s=ttft if ok else None,
        e2e_s=1.0 if ok else None,
        tpot_s=0.02 if ok else None,
        attempts=(Attempt(float(i), status, float(i) + (ttft if ok else 0.003), code),),
    )


def run(label: str, records: list[RequestRecord]) -> dict[str, Any]:
    return {"label": label, "summary": summarize(records)}


def test_comparison_table_has_ttft_p99_of_the_admitted() -> None:
    records = [record(i, ttft=0.1 * (i + 1)) for i in range(10)] + [record(10, 429, "x")]
    headers, rows = report.comparison_rows([run("gw @ 2x", records)])
    assert rows[0][headers.index("TTFT p99")] == "991.0"


def test_refusal_rows_by_run_and_code() -> None:
    gateway = [record(0), record(1, 429, "slo_unattainable"), record(2, 429, "tenant_rpm")]
    headers, rows = report.refusal_rows([run("direct @ 2x", [record(0)]), run("gw @ 2x", gateway)])
    assert headers == ["run", "429 code", "count", "p50 ms", "p99 ms", "max ms"]
    assert rows == [
        ["gw @ 2x", "slo_unattainable", "1", "3.0", "3.0", "3.0"],
        ["gw @ 2x", "tenant_rpm", "1", "3.0", "3.0", "3.0"],
    ]
    out = io.StringIO()
    report.print_table(headers, rows, out)
    assert "slo_unattainable" in out.getvalue()
    assert report.refusal_rows([run("direct", [record(0)])])[1] == []


def test_a_single_run_summary_names_its_refusals() -> None:
    head, _, _ = report.summary_lines(
        {**run("gw", [record(0), record(1, 429, "tenant_rpm")]), "target": {}}
    )
    assert any(
        line.startswith("429s by code") and "tenant_rpm ×1 p50 3.0 ms p99 3.0 ms" in line
        for line in head
    )


def test_slo_capacity_lines() -> None:
    search = SloSearch(4.0, max_probes=2).record(2.0, 1.0).record(3.0, 0.95)
    document = {"slo_capacity": {**search.to_dict(), "slo": "ttft≤1000ms, tpot≤50ms"}}
    assert report.slo_capacity_lines(document) == [
        "SLO capacity (direct, ≥ 99.0% of requests meeting ttft≤1000ms, tpot≤50ms): "
        "2.00 req/s (0.50× throughput)",
        "  probe 1: 2.00 req/s, 100.0% met, pass",
        "  probe 2: 3.00 req/s, 95.0% met, fail",
    ]
    none = SloSearch(4.0, max_probes=1).record(2.0, 0.5)
    document = {"slo_capacity": {**none.to_dict(), "slo": "ttft≤1000ms"}}
    assert "none: no probe met the SLOs" in report.slo_capacity_lines(document)[0]
    assert report.slo_capacity_lines({}) == []
