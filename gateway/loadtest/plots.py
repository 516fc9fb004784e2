"""PNG plots (matplotlib, Agg backend: no display needed). Imported only with `--plots`.

For one run or several side by side: latency CDFs (TTFT, TPOT, E2E), completions per second
over time, and the engines' KV usage and the gateway's queue over time. For a sweep, each
figure of the tuning table against the swept value.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib import ticker

DPI = 110


def write_run_plots(runs: Sequence[dict[str, Any]], out_dir: Path, prefix: str = "") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [_cdfs(runs, out_dir / f"{prefix}latency-cdf.png")]
    written.append(_over_time(runs, out_dir / f"{prefix}over-time.png"))
    return written


def _ok_values(run: dict[str, Any], key: str) -> list[float]:
    return sorted(
        r[key] * 1000
        for r in run["records"]
        if r["outcome"] == "ok" and not r["warmup"] and r.get(key) is not None
    )


def _cdfs(runs: Sequence[dict[str, Any]], path: Path) -> Path:
    keys = [("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, title) in zip(axes, keys, strict=True):
        for run in runs:
            values = _ok_values(run, key)
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=run.get("label", "?"))
        ax.set_title(f"{title} (successful requests)")
        ax.set_xlabel("ms")
        ax.set_ylabel("share of requests ≤ x")
        ax.grid(alpha=0.3)
        every = [v for run in runs for v in _ok_values(run, key)]
        if every and min(every) > 0 and max(every) / min(every) > 30:  # log only for wide spans
            ax.set_xscale("log")
            # Plain numbers on the major ticks, none on the minor ones (they overlap).
            ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))
            ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    _legend(axes[0])
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _over_time(runs: Sequence[dict[str, Any]], path: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for run in runs:
        label = run.get("label", "?")
        done = sorted(r["done_s"] for r in run["records"] if r["outcome"] == "ok")
        if done:
            buckets: dict[int, int] = {}
            for t in done:
                buckets[int(t)] = buckets.get(int(t), 0) + 1
            xs = list(range(int(done[-1]) + 1))
            axes[0].plot(xs, [buckets.get(x, 0) for x in xs], label=label)
        series = run.get("metrics", {}).get("series", {})
        engines = series.get("engines", {})
        lists = [samples for samples in engines.values() if samples]
        if lists:
            # Engines are scraped together: the n-th samples share a time; their mean is the
            # fleet's usage (one line per run keeps side-by-side runs readable).
            n = min(len(samples) for samples in lists)
            axes[1].plot(
                [lists[0][i]["t"] for i in range(n)],
                [sum(samples[i]["kv_usage"] for samples in lists) / len(lists) for i in range(n)],
                label=label,
            )
        gateway = series.get("gateway", [])
        if gateway:
            axes[2].plot(
                [s["t"] for s in gateway], [s["queue_length"] for s in gateway], label=label
            )
    axes[0].set_title("completions per second")
    axes[1].set_title("engine KV cache usage (mean over engines)")
    axes[1].set_ylim(0, 1.05)
    axes[2].set_title("gateway queue length")
    for ax in axes:
        ax.set_xlabel("s since the run's start")
        ax.grid(alpha=0.3)
    _legend(axes[0])
    _legend(axes[1])
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def write_sweep_plot(parameter: str, rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """`rows`: one per value with `value` and the figures of the tuning table."""
    figures = [
        ("ttft_mean_ms", "TTFT mean (ms)"),
        ("ttft_p95_ms", "TTFT p95 (ms)"),
        ("e2e_p95_ms", "E2E p95 (ms)"),
        ("success_rate", "success rate"),
        ("peak_kv_usage", "peak KV usage"),
        ("preemptions", "preemptions"),
        ("goodput", "goodput (req/s)"),
    ]
    fig, axes = plt.subplots(1, len(figures), figsize=(3.2 * len(figures), 3.4))
    labels = [str(r["value"]) for r in rows]
    for ax, (key, title) in zip(axes, figures, strict=True):
        ax.plot(
            labels, [r.get(key) if r.get(key) is not None else float("nan") for r in rows], "o-"
        )
        ax.set_title(title, fontsize="medium")
        ax.set_xlabel(parameter, fontsize="small")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
