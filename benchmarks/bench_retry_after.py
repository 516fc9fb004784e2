"""How good `Retry-After` is (issue 12): refused clients that follow it once, as the SDKs do.

One simulated engine (201 blocks of 16 tokens, `max_num_seqs` 16, 20 ms + 0.2 ms per
sequence a step) behind `kv-gateway serve` with a short line (`queue.max_length` 4,
`max_wait_s` 5); completions of 900 prompt and 64 output tokens (`ignore_eos`): 61 blocks,
three run at once. The load tool (`kv-gateway loadtest run --retry-429 1`) sends:

- `burst`: a finite burst, every request at once (`--rate inf`);
- `closed`: a closed loop of 2 × (running + line) clients, each sending its next request
  when the last one ended (refused or answered).

For each scenario, on a fresh gateway and engine: how many requests were refused at the
first try, the share of those whose (one) retry was not refused again, the advised delays,
how many advices were above 60 s (the OpenAI SDKs ignore those and back off 0.5-8 s
instead; so does the load tool), and how many were shorter than the time to the first
release after the refusal (the first answer the client side saw end after it) — the issue's
"no advised time shorter than the time to the first release".

    .venv/bin/python benchmarks/bench_retry_after.py                 # ~2 min
    .venv/bin/python benchmarks/bench_retry_after.py --json out.json
    .venv/bin/python benchmarks/bench_retry_after.py --workers 2   # serve --workers 2, Redis
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_overhead import STARTUP_TIMEOUT_S, Child, machine, start_engine

from gateway.harness import GatewayProcess

ENGINE = {"num_gpu_blocks": 201, "block_size": 16, "max_num_seqs": 16, "max_model_len": 2048}
QUEUE = {"max_length": 4, "max_wait_s": 5}
INPUT_LEN, OUTPUT_LEN = 900, 64
SDK_MAX_ADVICE_S = 60.0
# A release the client side sees ends a few ms after the gateway's: this much is not "early".
TOLERANCE_S = 0.05


def scenario_args(name: str, requests: int, clients: int) -> list[str]:
    if name == "burst":
        return ["--rate", "inf", "--requests", str(requests)]
    if name == "closed":
        return ["--concurrency", str(clients), "--requests", str(requests)]
    raise SystemExit(f"unknown scenario {name!r}")


def measure(
    name: str,
    requests: int,
    clients: int,
    seed: int,
    keep: Path | None = None,
    workers: int = 1,
    redis_url: str = "redis://127.0.0.1:6379",
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-retry-") as tmp:
        workdir = Path(tmp)
        children: list[Child] = []
        try:
            engine, engine_url = start_engine(workdir, ENGINE, decode_ms=(20, 0.2))
            children.append(engine)
            cfg = {
                "engines": [{"name": "sim", "url": engine_url, "models": ["tiny"], **ENGINE}],
                "models": [{"name": "tiny", "tokenizer": "hf:@tiny"}],
                "queue": QUEUE,
                "admission": {"kv_ceiling": 0.95},
            }
            args: list[str] = []
            if workers > 1:  # several processes share their state through Redis
                cfg["redis"] = {"url": redis_url, "key_prefix": f"bench-retry-{os.getpid()}"}
                args = ["--workers", str(workers)]
            process = GatewayProcess(
                cfg, workdir, args=args, startup_timeout_s=STARTUP_TIMEOUT_S, own_group=True
            )
            children.append(process.start())
            gateway_url = process.url
            out = workdir / "run.json"
            command = [
                sys.executable, "-m", "gateway.cli", "loadtest", "run",
                "--target", gateway_url, "--api", "completions", "--no-stream",
                "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
                "--retry-429", "1", "--seed", str(seed), "--timeout", "120",
                "--json", str(out), "--quiet",
                *scenario_args(name, requests, clients),
            ]  # fmt: skip
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            report = json.loads(out.read_text(encoding="utf-8"))
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                (keep / f"{name}.json").write_text(out.read_text(encoding="utf-8"))
        finally:
            for child in reversed(children):
                child.stop()
    return summarise(report["records"])


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one run, from the load tool's records."""
    ends = sorted(r["done_s"] for r in records if r["outcome"] == "ok")
    first_refused = [r for r in records if r["attempts"] and r["attempts"][0]["status"] == 429]
    retried = [r for r in records if len(r["attempts"]) > 1]
    at_first = [r for r in retried if r["attempts"][1]["status"] != 429]
    second_refusals: dict[str, int] = {}
    for r in retried:
        if r["attempts"][1]["status"] == 429:
            code = r["attempts"][1].get("code") or "?"
            second_refusals[code] = second_refusals.get(code, 0) + 1
    advised: list[float] = []
    early = over_sdk = 0
    for r in records:
        for attempt in r["attempts"]:
            if attempt["status"] != 429 or attempt.get("advised_s") is None:
                continue
            refused_at, advice = attempt["answered_s"], attempt["advised_s"]
            advised.append(advice)
            over_sdk += advice > SDK_MAX_ADVICE_S
            i = bisect.bisect_right(ends, refused_at)
            if i < len(ends) and refused_at + advice < ends[i] - TOLERANCE_S:
                early += 1
    codes: dict[str, int] = {}
    for r in records:
        if r["outcome"] != "ok":
            code = r.get("reason") or r["outcome"]
            codes[code] = codes.get(code, 0) + 1
    span = max(r["done_s"] for r in records) - min(r["sent_s"] for r in records)
    latencies = [r["done_s"] - r["sent_s"] for r in records if r["outcome"] == "ok"]
    return {
        "requests": len(records),
        "ok": len(ends),
        "ok_per_s": round(len(ends) / span, 3) if span > 0 else None,
        "ok_latency_p50_s": round(statistics.median(latencies), 2) if latencies else None,
        "not_ok": codes,
        "first_try_refused": len(first_refused),
        "retried": len(retried),
        "admitted_at_first_retry": round(len(at_first) / len(retried), 4) if retried else None,
        "first_retry_refused_by": second_refusals,
        "advices": len(advised),
        "advised_s_min_p50_max": [
            round(min(advised), 2),
            round(statistics.median(advised), 2),
            round(max(advised), 2),
        ]
        if advised
        else None,
        "advices_over_60s": over_sdk,
        "advices_shorter_than_next_release": early,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default="burst,closed")
    parser.add_argument("--burst-requests", type=int, default=150)
    parser.add_argument("--closed-requests", type=int, default=300)
    parser.add_argument("--clients", type=int, default=14, help="closed loop (default 2 × 7)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", type=Path, help="keep the load tool's JSON reports here")
    parser.add_argument("--workers", type=int, default=1, help="serve --workers N (Redis)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    print(f"engine {ENGINE}, queue {QUEUE}, {INPUT_LEN} + {OUTPUT_LEN} tokens, --retry-429 1")
    results = {}
    for name in args.scenarios.split(","):
        requests = args.burst_requests if name == "burst" else args.closed_requests
        results[name] = measure(
            name, requests, args.clients, args.seed, args.keep, args.workers, args.redis_url
        )
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
