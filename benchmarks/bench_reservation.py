"""`worst_case` against `predicted` reservations, same engine, same load, one run.

    python benchmarks/bench_reservation.py [--seconds 20] [--clients 48] [--long-fraction 0.1]
        [--parallel N]

For each mode, a fresh simulated engine (`python -m gateway.sim`: 512 usable blocks of 16
tokens, max_num_seqs 64, 8 ms + 0.1 ms per sequence per decode step) and a fresh
`kv-gateway serve` in front of it (`--kv-ceiling`, default 1.0; queue 1024 × 60 s;
`predicted`: quantile 0.9 of the last 1,000 outputs, after 50) take the same closed-loop
load: `--clients`
clients, each sending one completion after another, prompts of 10–200 token ids, and
`max_tokens` 1024, a loose upper bound as clients often ask. Most requests stop naturally
after 1–96 tokens (the simulator's EOS); `--long-fraction` of them ignore EOS and really
produce 600 tokens, far beyond any prediction. With `--stream` the answers are streamed,
and the gateway extends a stream's lease as it outgrows its prediction. After `--warmup-s`
(the predictor learns; it is not measured) the script counts, for `--seconds`: requests
completed per second, output tokens per second, latency p50/p95, 429s, and from the engine
the preemptions and the peak of running requests; then a table of the settings and, for each
adaptive one, the curve of the fixed settings at its preemption rate. With a long tail, give
a warm-up of several times the long answers' duration (`--warmup-s 45` in docs/benchmarks.md):
the predictor learns from completed requests, and the long ones complete last.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from bench_overhead import Child, machine, start_engine, start_gateway

ENGINE = {"num_gpu_blocks": 513, "block_size": 16, "max_num_seqs": 64, "max_model_len": 2048}
MAX_TOKENS = 1024
LONG_TOKENS = 600


@dataclass(frozen=True)
class Setting:
    """One gateway setting to measure: `mode[:quantile][@ceiling][/target]`, e.g.
    `worst_case`, `predicted:0.8@0.9`, `adaptive/1` (target preemptions per 1,000)."""

    mode: str
    quantile: float = 0.9
    ceiling: float = 1.0
    target: float = 1.0

    @classmethod
    def parse(cls, text: str, ceiling: float) -> Setting:
        rest, _, target = text.partition("/")
        rest, _, at = rest.partition("@")
        mode, _, quantile = rest.partition(":")
        if mode not in ("worst_case", "predicted", "adaptive"):
            raise SystemExit(f"unknown mode in {text!r}")
        return cls(
            mode,
            float(quantile or 0.9),
            float(at or ceiling),
            float(target or 1.0),
        )

    @property
    def label(self) -> str:
        label = self.mode
        if self.mode == "predicted":
            label += f" q={self.quantile:g}"
        if self.mode == "adaptive":
            label += f" target={self.target:g}/1000"
        return label + (f" ceiling={self.ceiling:g}" if self.ceiling != 1.0 else "")


def start(workdir: Path, setting: Setting) -> tuple[list[Child], str, str]:
    engine, engine_url = start_engine(
        workdir, ENGINE, decode_ms=(8, 0.1), prefill_ms_per_token=0.005
    )
    cfg = {
        "engines": [{"name": "sim", "url": engine_url, **ENGINE}],
        "models": [{"name": "tiny", "tokenizer": "hf:@tiny"}],
        "queue": {"max_length": 1024, "max_wait_s": 60},
        "admission": {
            "kv_ceiling": setting.ceiling,
            "reservation": setting.mode,
            "prediction": {"quantile": setting.quantile, "window": 1000, "min_samples": 50},
            "adaptive": {"target_preemptions_per_1000": setting.target},
        },
        "health": {"scrape_interval_s": 0.5},
    }
    gateway, gateway_url = start_gateway(workdir, cfg)
    return [gateway, engine], engine_url, gateway_url


def completion_tokens(text: str, *, stream: bool) -> int:
    if not stream:
        return int(json.loads(text)["usage"]["completion_tokens"])
    for line in reversed(text.splitlines()):
        if line.startswith("data: {") and '"usage": {' in line.replace('"usage":{', '"usage": {'):
            return int(json.loads(line[6:])["usage"]["completion_tokens"])
    return 0


async def load(
    gateway_url: str, engine_url: str, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    measuring = False
    latencies: list[float] = []
    outputs = 0
    refused = 0
    errors = 0
    stop = asyncio.Event()

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal outputs, refused, errors
        while not stop.is_set():
            long = rng.random() < args.long_fraction
            body = {
                "model": "tiny",
                "prompt": [rng.randrange(100, 2000) for _ in range(rng.randint(10, 200))],
                "max_tokens": LONG_TOKENS if long else MAX_TOKENS,
                "ignore_eos": long,
            }
            if args.stream:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
            started = time.monotonic()
            try:
                r = await http.post(gateway_url + "/v1/completions", json=body)
            except httpx.HTTPError:
                errors += measuring
                continue
            if not measuring:
                continue
            if r.status_code == 200:
                latencies.append(time.monotonic() - started)
                outputs += completion_tokens(r.text, stream=args.stream)
            elif r.status_code == 429:
                refused += 1
                await asyncio.sleep(float(r.headers.get("retry-after", "1")))
            else:
                errors += 1

    async with httpx.AsyncClient(
        timeout=120, limits=httpx.Limits(max_connections=args.clients, keepalive_expiry=2)
    ) as http:
        tasks = [asyncio.create_task(client(http)) for _ in range(args.clients)]
        await asyncio.sleep(args.warmup_s)
        before = (await http.get(engine_url + "/sim/state")).json()
        measuring = True
        t0 = time.monotonic()
        peak_running = 0
        while time.monotonic() - t0 < args.seconds and (
            args.requests is None or len(latencies) < args.requests
        ):
            await asyncio.sleep(0.1)
            state = (await http.get(engine_url + "/sim/state")).json()
            peak_running = max(peak_running, state["running"])
        measuring = False
        elapsed = time.monotonic() - t0
        after = (await http.get(engine_url + "/sim/state")).json()
        stop.set()
        await asyncio.gather(*tasks)
        predicted = quantile = margin = None
        for line in (await http.get(gateway_url + "/metrics")).text.splitlines():
            if line.startswith("kv_gateway_predicted_output_tokens{"):
                predicted = float(line.rsplit(" ", 1)[1])
            if line.startswith("kv_gateway_reserved_quantile{"):
                quantile = float(line.rsplit(" ", 1)[1])
            if line.startswith("kv_gateway_reserved_margin{"):
                margin = float(line.rsplit(" ", 1)[1])
    done = len(latencies)
    q = statistics.quantiles(latencies, n=20) if done >= 2 else [float("nan")] * 19
    return {
        "completed_per_s": done / elapsed,
        "output_tokens_per_s": outputs / elapsed,
        "latency_p50_s": statistics.median(latencies) if latencies else float("nan"),
        "latency_p95_s": q[18],
        "refused_429": refused,
        "errors": errors,
        "completed": done,
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        "preemptions_per_1000": 1000
        * (after["num_preemptions"] - before["num_preemptions"])
        / max(1, done),
        "peak_running": peak_running,
        "predicted_output_tokens": predicted,
        "adaptive_quantile_at_end": quantile,
        "adaptive_margin_at_end": margin,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=48)
    parser.add_argument("--long-fraction", type=float, default=0.1)
    parser.add_argument("--kv-ceiling", type=float, default=1.0)
    parser.add_argument(
        "--stream", action="store_true", help="streamed answers (the lease follows the tokens)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--requests", type=int, help="stop measuring after this many completed requests"
    )
    parser.add_argument(
        "--settings",
        default="worst_case,predicted",
        help="comma list of mode[:quantile][@ceiling][/target], e.g. "
        "worst_case,predicted:0.8,predicted:0.9@0.9,adaptive/1",
    )
    parser.add_argument(
        "--parallel", type=int, default=1, help="settings measured at the same time (default 1)"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="PNG: throughput against preemptions/1000")
    parser.add_argument("--plot-note", default="", help="a second title line for the plot")
    parser.add_argument(
        "--replot", type=Path, help="only plot (and compare) the results of an earlier --json"
    )
    args = parser.parse_args()
    if args.replot:
        results = json.loads(args.replot.read_text())["results"]
        against_curve(results)
        if args.plot:
            plot(results, args.plot, note=args.plot_note)
        return 0
    settings = [Setting.parse(t, args.kv_ceiling) for t in args.settings.split(",")]
    print(f"machine: {machine()}")
    print(
        f"engine {ENGINE}; {args.clients} clients, max_tokens {MAX_TOKENS} "
        f"({args.long_fraction:.0%} ignore EOS and produce {LONG_TOKENS}); "
        f"{'streamed' if args.stream else 'whole'} answers; "
        f"warm-up {args.warmup_s:g} s, measured {args.seconds:g} s"
        + (f" or {args.requests} requests" if args.requests else "")
    )
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-reservation-") as tmp:

        def measure(i: int, setting: Setting) -> None:
            workdir = Path(tmp) / str(i)
            workdir.mkdir()
            children, engine_url, gateway_url = start(workdir, setting)
            try:
                result = asyncio.run(load(gateway_url, engine_url, args, args.seed))
            finally:
                for child in children:
                    child.stop()
            results[setting.label] = result
            lines = [f"\n{setting.label}:"]
            for key, value in result.items():
                lines.append(f"  {key:24} {value:.3f}" if isinstance(value, float) else
                             f"  {key:24} {value}")  # fmt: skip
            print("\n".join(lines), flush=True)

        # --parallel N: N settings at a time, each on its own engine and gateway, one event
        # loop per thread; they share the machine as they share its load, a fairer
        # comparison on a busy machine than one after another.
        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            for done in [pool.submit(measure, i, s) for i, s in enumerate(settings)]:
                done.result()
        results = {s.label: results[s.label] for s in settings}
    print(f"\n{'setting':36} {'completed/s':>12} {'preempt/1000':>13} {'completed':>10}")
    for label, r in results.items():
        print(
            f"{label:36} {r['completed_per_s']:>12.2f} {r['preemptions_per_1000']:>13.2f} "
            f"{r['completed']:>10}"
        )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json),
                                         "plot": str(args.plot)}, "results": results},
                                        indent=2))  # fmt: skip
    against_curve(results)
    if args.plot:
        plot(results, args.plot, note=args.plot_note)
    return 0


def frontier(results: dict[str, dict[str, Any]]) -> list[tuple[float, float]]:
    """The fixed settings' curve: (preemptions/1000, completed/s) of each non-adaptive
    setting that no other beats on both (fewer preemptions and more throughput), by
    preemptions."""
    points = sorted(
        (r["preemptions_per_1000"], -r["completed_per_s"])
        for label, r in results.items()
        if not label.startswith("adaptive")
    )
    curve: list[tuple[float, float]] = []
    for x, minus_y in points:
        if not curve or -minus_y > curve[-1][1]:
            curve.append((x, -minus_y))
    return curve


def curve_at(curve: list[tuple[float, float]], x: float) -> float | None:
    """The curve's throughput at `x` preemptions/1000 (straight lines between its points;
    the first point's below it); None past its last point."""
    if not curve or x > curve[-1][0]:
        return None
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(curve):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else max(y0, y1)
    return None


def against_curve(results: dict[str, dict[str, Any]]) -> None:
    """For each adaptive setting: the curve's throughput at its preemption rate."""
    curve = frontier(results)
    for label, r in results.items():
        if not label.startswith("adaptive"):
            continue
        at = curve_at(curve, r["preemptions_per_1000"])
        if at is None:
            print(f"{label}: past the curve's last point")
            continue
        print(
            f"{label}: {r['completed_per_s']:.2f} req/s against {at:.2f} on the curve at "
            f"{r['preemptions_per_1000']:.2f} preemptions/1000 "
            f"({r['completed_per_s'] / at - 1:+.1%})"
        )


def plot(results: dict[str, dict[str, Any]], path: Path, note: str = "") -> None:
    """Throughput against preemptions per 1,000 requests, one point per setting, and the
    curve of the fixed settings."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install 'kv-gateway[loadtest]')")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    curve = frontier(results)
    ax.plot([x for x, _ in curve], [y for _, y in curve], color="0.6", lw=1, zorder=1,
            label="curve of the fixed settings")  # fmt: skip
    for label, r in results.items():
        adaptive = label.startswith("adaptive")
        ax.scatter(r["preemptions_per_1000"], r["completed_per_s"], zorder=2,
                   marker="*" if adaptive else "o", s=160 if adaptive else 50,
                   color="tab:red" if adaptive else "tab:blue")  # fmt: skip
        ax.annotate(label, (r["preemptions_per_1000"], r["completed_per_s"]), fontsize=7,
                    xytext=(5, -10 if adaptive else 4), textcoords="offset points")  # fmt: skip
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlim(left=-0.2)
    ax.set_xlabel("preemptions per 1,000 completed requests (linear below 1, log above)")
    ax.set_ylabel("completed requests per second")
    ax.set_title("Reservation settings on a long-tail workload" + (f"\n{note}" if note else ""),
                 fontsize=9)  # fmt: skip
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    raise SystemExit(main())
