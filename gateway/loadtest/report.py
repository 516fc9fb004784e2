"""Reports: the summary printed at the end (a rich table when `rich` is installed, plain
text otherwise) and the JSON file (`--json`: every aggregate and every request record)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

LATENCY_ROWS = ("ttft", "tpot", "itl", "e2e")
LATENCY_COLS = ("mean", "p50", "p90", "p95", "p99")


def have_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=_jsonable) + "\n", encoding="utf-8")


def _jsonable(value: object) -> object:
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    return str(value)


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f} %"


def summary_lines(report: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str]]:
    """(lines before the latency table, the table's rows, lines after it)."""
    s = report["summary"]
    target = report.get("target", {})
    head = [
        f"target {target.get('name')} ({target.get('kind')}, {', '.join(target.get('urls', []))})"
        f" · model {report.get('model')}",
    ]
    for line in report.get("workload", {}).get("tenants", []):
        head.append(f"  load: {line}")
    o = s["outcomes"]
    r = s["retries"]
    head.append(
        f"{s['requests']} requests in {s['duration_s']:.1f} s: {o['ok']} ok, {o['refused']} "
        f"refused (429), {o['error']} errors, {o['cancelled']} cancelled · success "
        f"{pct(s['success_rate'])}"
    )
    t = s["throughput"]
    head.append(
        f"throughput {fmt(t['requests_per_s'], 2)} req/s, {fmt(t['output_tokens_per_s'])} output "
        f"tok/s · goodput {fmt(t['goodput_requests_per_s'], 2)} req/s (SLO {s['slo']})"
    )
    if r["first_try_refused"] or r["retries"]:
        head.append(
            f"429s: {r['first_try_refused']} refused at the first try, {r['retries']} retries, "
            f"{r['retried_then_ok']} admitted after retrying, {r['retried_then_refused']} still "
            f"refused · admitted at the first retry {pct(r['admitted_at_first_retry'])}"
            + (
                f" · advice gap p50 {fmt(r['advice_gap_ms']['p50'])} ms"
                if r["advice_gap_ms"]
                else ""
            )
        )
    refusals = s.get("refusals", {})
    if refusals:
        head.append(
            "429s by code (time to the refusal): "
            + ", ".join(
                f"{code} ×{r['count']} p50 {fmt((r['latency_ms'] or {}).get('p50'))} ms "
                f"p99 {fmt((r['latency_ms'] or {}).get('p99'))} ms"
                for code, r in refusals.items()
            )
        )
    rows = []
    for name in LATENCY_ROWS:
        stats = s["latency_ms"][name]
        if stats:
            rows.append([name.upper(), *(fmt(stats[c]) for c in LATENCY_COLS)])
    tail = []
    m = report.get("metrics", {}).get("summary", {})
    if "peak_kv_usage" in m:
        tail.append(
            f"engines: peak KV usage {pct(m['peak_kv_usage'])}, peak running "
            f"{m['peak_running']}, peak waiting {m['peak_waiting']}, preemptions "
            f"{m['preemptions']}"
            + (
                f", prefix cache hit rate {pct(m['prefix_cache_hit_rate'])}"
                if "prefix_cache_hit_rate" in m
                else ""
            )
        )
    if "gateway_peak_queue" in m:
        tail.append(
            f"gateway: peak queue {m['gateway_peak_queue']}, answers {m['gateway_answers']}"
        )
    if s["failures"]:
        tail.append("failures: " + ", ".join(f"{k} ×{v}" for k, v in s["failures"].items()))
    c = report.get("client", {})
    if c:
        tail.append(
            f"client: {pct(c.get('cpu_share_of_core'))} of a core on average, "
            f"{pct(c.get('peak_window_share'))} in its busiest second"
        )
    for warning in report.get("warnings", []):
        tail.append(f"WARNING: {warning}")
    if report.get("interrupted"):
        tail.append("interrupted: the figures cover what finished before the stop")
    return head, rows, tail


def print_summary(report: dict[str, Any], out: TextIO | None = None) -> None:
    out = out or sys.stdout
    head, rows, tail = summary_lines(report)
    for line in head:
        print(line, file=out)
    print_table(["latency (ms)", *LATENCY_COLS], rows, out)
    for line in tail:
        print(line, file=out)


def print_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], out: TextIO | None = None
) -> None:
    out = out or sys.stdout
    if not rows:
        return
    if have_rich() and out is sys.stdout and out.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(show_edge=False, pad_edge=False)
        for n, header in enumerate(headers):
            table.add_column(header, justify="left" if n == 0 else "right")
        for row in rows:
            table.add_row(*row)
        Console().print(table)
        return
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = [headers, *rows]
    for n, line in enumerate(lines):
        cells = [
            str(c).ljust(widths[i]) if i == 0 else str(c).rjust(widths[i])
            for i, c in enumerate(line)
        ]
        print("  ".join(cells).rstrip(), file=out)
        if n == 0:
            print("  ".join("-" * w for w in widths), file=out)


def comparison_rows(runs: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """One row per run: the figures a compare or a sweep puts side by side."""
    headers = [
        "run",
        "req/s",
        "out tok/s",
        "goodput",
        "success",
        "429 first",
        "retries",
        "TTFT mean",
        "TTFT p50",
        "TTFT p95",
        "TTFT p99",
        "TPOT p50",
        "E2E p95",
        "peak KV",
        "preempt",
        "prefix hit",
    ]
    rows = []
    for run in runs:
        s = run["summary"]
        lat = s["latency_ms"]
        m = run.get("metrics", {}).get("summary", {})
        rows.append(
            [
                run.get("label", run.get("target", {}).get("name", "?")),
                fmt(s["throughput"]["requests_per_s"], 2),
                fmt(s["throughput"]["output_tokens_per_s"], 0),
                fmt(s["throughput"]["goodput_requests_per_s"], 2),
                pct(s["success_rate"]),
                str(s["retries"]["first_try_refused"]),
                str(s["retries"]["retries"]),
                _lat(lat, "ttft", "mean"),
                _lat(lat, "ttft", "p50"),
                _lat(lat, "ttft", "p95"),
                _lat(lat, "ttft", "p99"),
                _lat(lat, "tpot", "p50"),
                _lat(lat, "e2e", "p95"),
                pct(m.get("peak_kv_usage")),
                str(m.get("preemptions", "-")),
                pct(m.get("prefix_cache_hit_rate")),
            ]
        )
    return headers, rows


def slo_capacity_lines(document: dict[str, Any]) -> list[str]:
    """The SLO capacity search, as printed: the rate chosen, then each probe."""
    found = document.get("slo_capacity")
    if found is None:
        return []
    rate, share = found["requests_per_s"], f"{found['quantile']:.1%}"
    head = f"SLO capacity (direct, ≥ {share} of requests meeting {found['slo']}): " + (
        f"{rate:.2f} req/s ({rate / found['throughput_requests_per_s']:.2f}× throughput)"
        if rate is not None
        else f"none: no probe met the SLOs for {share} of its requests"
    )
    lines = [head]
    for n, p in enumerate(found["probes"], start=1):
        verdict = "pass" if p["passed"] else "fail"
        lines.append(f"  probe {n}: {p['rate']:.2f} req/s, {p['met']:.1%} met, {verdict}")
    return lines


def refusal_rows(runs: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """One row per run and error code of its 429s: how many, and how fast they came (ms from
    the attempt's send to the refusal). No rows when no run was refused."""
    headers = ["run", "429 code", "count", "p50 ms", "p99 ms", "max ms"]
    rows = []
    for run in runs:
        for code, refused in run["summary"].get("refusals", {}).items():
            stats = refused["latency_ms"] or {}
            rows.append(
                [
                    run.get("label", run.get("target", {}).get("name", "?")),
                    code,
                    str(refused["count"]),
                    fmt(stats.get("p50")),
                    fmt(stats.get("p99")),
                    fmt(stats.get("max")),
                ]
            )
    return headers, rows


def _lat(latency: dict[str, Any], name: str, col: str) -> str:
    stats = latency.get(name)
    return fmt(stats[col]) if stats else "-"
