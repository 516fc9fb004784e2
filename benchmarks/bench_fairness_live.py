"""Fairness under load, end to end: a quiet tenant next to a 10x flooder, on running gateways.

    .venv/bin/python benchmarks/bench_fairness_live.py --scenario a [--state memory|redis]
        [--replicas 1|3] [--seconds 120] [--scale 4] [--seed 1] [--set admission.share_headroom=0]

Processes on 127.0.0.1, started through `gateway.harness`: one simulated engine (256 blocks
of 16 tokens: 242 admissible at the 0.95 ceiling), `--replicas` `kv-gateway serve` in front
of it (in-process state, or a private `redis-server` shared by all), and the load-test tool
(`kv-gateway loadtest run --workload`) with two tenants of equal weight: `quiet` and
`flood`, each request 800 prompt + 128 output tokens = 58 blocks (four fit at once), streamed.
A request alone takes about 2.5 s / `--scale` (the sim's step time is scaled down so that a
run of two minutes holds enough requests; rates are scaled up alike).

The quiet tenant's *wait* is the time to the response headers (queueing + admission: the
gateway sends its headers once the engine answers), taken from the tool's per-request
records; p95 over the requests sent after the first 10 % of the run. Per scenario, in the
same run (the quiet tenant sends the same requests at the same times in each: the tool
seeds every tenant's arrivals by its name):

- `a`: quiet at 0.25 req/s (x scale) alone, then with the flooder at 10x its rate. Target:
  flooded p95 <= 1.2 x alone p95 + 0.3 x one service time.
- `b`: quiet at 0.5 req/s alone on an engine cut to half (128 blocks: its weighted share, a
  static partition), then with the flooder on the whole engine. Target: flooded p95 <=
  partition p95, and no quiet request refused or failed.
- `c`: the flooder alone, then with the quiet tenant (at the `b` rate): how much of the
  engine is reserved on average (the gateway's `kv_gateway_reserved_blocks`, scraped every
  0.5 s) and the flooder's completed requests per second.

`--set KEY=VALUE` overrides the gateways' config (dotted keys; e.g. the negative control
without fair queuing: `--set admission.share_headroom=0 --set queue.fair_burst_blocks=0`).
Prints figures and writes them with `--json`; asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from gateway.harness import GatewayProcess, RedisServer, SimProcess
from gateway.loadtest.cpu import cpu_seconds, loadavg, machine

KEYS = {"quiet": "quiet-key-0123456789", "flood": "flood-key-0123456789"}
ADMIN_KEY = "admin-key-0123456789"
PROMPT, OUTPUT = 800, 128  # 928 tokens = 58 blocks of 16
BLOCKS = 256  # 255 usable x 0.95 = 242 admissible
SERVICE_S = 2.5  # a request alone, at scale 1 (128 decode steps of ~19.5 ms)
RATES = {"a": 0.25, "b": 0.5, "c": 0.5}
# The same loads as fractions of the quiet tenant's share (two of the four slots), for
# `--calibrate`: 0.25 and 0.5 req/s x 2.5 s = a third and two thirds of two slots.
SHARE_FRACTIONS = {"a": 0.3125, "b": 0.625, "c": 0.625}
FLOOD_FACTOR = 10


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def set_dotted(cfg: dict[str, Any], dotted: str) -> None:
    key, _, raw = dotted.partition("=")
    *path, last = key.split(".")
    node = cfg
    for part in path:
        node = node.setdefault(part, {})
    node[last] = yaml.safe_load(raw)


def gateway_config(engine_url: str, redis_url: str | None, sets: Sequence[str]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "engines": [{"name": "e0", "url": engine_url, "max_num_seqs": 64}],
        "models": [{"name": "tiny", "tokenizer": "hf:@tiny"}],
        "admission": {"kv_ceiling": 0.95},
        "queue": {"max_length": 256, "max_wait_s": 30.0},
        "tenants": [
            {"name": name, "api_keys": [digest(key)], "weight": 1} for name, key in KEYS.items()
        ],
        "admin": {"api_keys": [digest(ADMIN_KEY)]},
        "health": {"scrape_interval_s": 0.5},
    }
    if redis_url is not None:
        cfg["redis"] = {"url": redis_url, "key_prefix": f"fair{os.getpid()}", "timeout_s": 3}
    for dotted in sets:
        set_dotted(cfg, dotted)
    return cfg


def workload(rates: dict[str, float], path: Path) -> Path:
    tenants = [
        {
            "name": name,
            "api_key_env": f"KVGW_BENCH_{name.upper()}_KEY",
            "rate": rate,
            "api": "completions",
            "stream": True,
            "token_ids": True,
            "input_len": PROMPT,
            "output_len": OUTPUT,
        }
        for name, rate in rates.items()
    ]
    path.write_text(yaml.safe_dump({"tenants": tenants}, sort_keys=False))
    return path


@contextlib.contextmanager
def deployment(
    workdir: Path,
    *,
    blocks: int,
    state: str,
    replicas: int,
    scale: float,
    sets: Sequence[str],
    access_log: bool = False,
) -> Iterator[tuple[list[GatewayProcess], dict[str, int]]]:
    """A fresh engine and fresh gateways (and a fresh Redis): every run starts clean.
    Yields the gateways and the pids whose CPU the run reports."""
    step_ms = SERVICE_S / OUTPUT * 1000 / scale
    engine = SimProcess(
        workdir=workdir,
        num_gpu_blocks=blocks,
        max_num_seqs=64,
        max_model_len=1024,
        decode_ms_base=step_ms,
        decode_ms_per_seq=0.0,
        prefill_ms_per_token=0.0,
        own_group=True,
    ).start()
    redis = RedisServer().start() if state == "redis" else None
    gateways: list[GatewayProcess] = []
    try:
        cfg = gateway_config(engine.url, redis.url if redis else None, sets)
        logging: dict[str, Any] = (
            {"log_level": "info", "args": ["--log-format", "json"]} if access_log else {}
        )
        for _ in range(replicas):
            gateways.append(GatewayProcess(cfg, workdir, own_group=True, **logging).start())
        pids = {
            "engine": engine.pid or 0,
            **{f"gateway{i}": g.pid or 0 for i, g in enumerate(gateways)},
        }
        if redis is not None and redis.proc is not None:
            pids["redis-server"] = redis.proc.pid
        yield gateways, pids
    finally:
        for gw in gateways:
            gw.stop()
        engine.stop()
        if redis is not None:
            redis.stop()


def run_load(
    gateways: list[GatewayProcess], rates: dict[str, float], seconds: float, seed: int, out: Path
) -> dict[str, Any]:
    env = {**os.environ, "KVGW_BENCH_ADMIN_KEY": ADMIN_KEY}
    env.update({f"KVGW_BENCH_{n.upper()}_KEY": k for n, k in KEYS.items()})
    argv = [
        str(Path(sys.executable).with_name("kv-gateway")),
        "loadtest",
        "run",
        "--target",
        ",".join(g.url for g in gateways),
        "--workload",
        str(workload(rates, out.with_suffix(".yaml"))),
        "--duration",
        str(seconds),
        "--seed",
        str(seed),
        "--retry-429",
        "0",
        "--timeout",
        "120",
        "--scrape-interval",
        "0.5",
        "--admin-key-env",
        "KVGW_BENCH_ADMIN_KEY",
        "--api-key-env",
        "KVGW_BENCH_QUIET_KEY",
        "--model",
        "tiny",
        "--json",
        str(out),
    ]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"loadtest failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def tenant_figures(report: dict[str, Any], tenant: str, seconds: float) -> dict[str, Any]:
    records = [
        r
        for r in report["records"]
        if r["tenant"] == tenant and r["sent_s"] >= 0.1 * seconds and not r["warmup"]
    ]
    ok = [r for r in records if r["outcome"] == "ok"]
    waits = [
        r["attempts"][0]["answered_s"] - r["attempts"][0]["sent_s"]
        for r in ok
        if r["attempts"] and r["attempts"][0].get("answered_s") is not None
    ]
    codes: dict[str, int] = {}
    for r in records:
        if r["outcome"] != "ok":
            key = str(r.get("reason") or r["status"])
            codes[key] = codes.get(key, 0) + 1
    span = max((r["done_s"] for r in ok), default=0.0) - 0.1 * seconds
    return {
        "sent": len(records),
        "ok": len(ok),
        "not_ok": codes,
        "wait_p50_s": percentile(waits, 50),
        "wait_p95_s": percentile(waits, 95),
        "e2e_p50_s": statistics.median(r["e2e_s"] for r in ok) if ok else float("nan"),
        "ok_per_s": len(ok) / span if span > 0 else 0.0,
    }


def reserved_fraction(report: dict[str, Any], seconds: float, capacity: int) -> float | None:
    """Mean of the gateway's reserved blocks over the run (after the first 10 %)."""
    points: list[float] = []
    for sample in report.get("metrics", {}).get("series", {}).get("gateway", []):
        if sample.get("t", 0) >= 0.1 * seconds and sample.get("reserved_blocks") is not None:
            points.append(float(sample["reserved_blocks"]))
    return statistics.mean(points) / capacity if points else None


def access_records(gateways: Sequence[GatewayProcess], tenant: str) -> list[dict[str, Any]]:
    """The gateways' access lines (`--log-format json`) of one tenant's requests."""
    out = []
    for gw in gateways:
        for line in gw.log_text().splitlines():
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("logger") == "gateway.access" and rec.get("tenant") == tenant:
                out.append(rec)
    return out


def breakdown(records: list[dict[str, Any]], skip: float) -> dict[str, Any]:
    """Where the tenant's time to first byte went, from the gateways' side: `wait` (arrival
    to a reservation: the gateway's line and admission) and `engine` (reservation to the
    engine's first byte), p50 / p95 / max over the requests answered after the first
    `skip` of them (the run's warm-up, as the tool's figures skip it); and the five longest
    first bytes, split the same way."""
    ok = [r for r in records if r.get("first_byte_ms") is not None and r.get("wait_ms") is not None]
    ok.sort(key=lambda r: r["ts"])
    ok = ok[int(skip * len(ok)) :]
    waits = [r["wait_ms"] / 1000 for r in ok]
    engine = [(r["first_byte_ms"] - r["wait_ms"]) / 1000 for r in ok]
    first = [r["first_byte_ms"] / 1000 for r in ok]
    worst = sorted(ok, key=lambda r: r["first_byte_ms"], reverse=True)[:5]
    return {
        "n": len(ok),
        **{
            f"{name}_{q}_s": percentile(xs, q)
            for name, xs in (("wait", waits), ("engine", engine), ("first_byte", first))
            for q in (50, 95)
        },
        "worst": [
            {
                "first_byte_s": r["first_byte_ms"] / 1000,
                "wait_s": r["wait_ms"] / 1000,
                "engine_s": (r["first_byte_ms"] - r["wait_ms"]) / 1000,
            }
            for r in worst
        ],
    }


def calibrate(scale: float) -> float:
    """The median time of five requests sent one at a time to an idle gateway."""
    import httpx

    body = {
        "model": "tiny",
        "prompt": list(range(100, 100 + PROMPT)),
        "max_tokens": OUTPUT,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {KEYS['quiet']}"}
    with (
        tempfile.TemporaryDirectory(prefix="bench-fair-cal-") as tmp,
        deployment(Path(tmp), blocks=BLOCKS, state="memory", replicas=1, scale=scale, sets=()) as (
            gws,
            _,
        ),
    ):
        times = []
        with httpx.Client(timeout=60) as http:
            for _ in range(5):
                t0 = time.monotonic()
                with http.stream(
                    "POST", gws[0].url + "/v1/completions", json=body, headers=headers
                ) as r:
                    r.raise_for_status()
                    for _chunk in r.iter_bytes():
                        pass
                times.append(time.monotonic() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_fairness_live.py", description=__doc__.splitlines()[0])
    p.add_argument("--scenario", choices=["a", "b", "c"], required=True)
    p.add_argument("--state", choices=["memory", "redis"], default="memory")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--scale", type=float, default=4.0, help="time runs this much faster")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure the service time first and set the rates as fractions of the share",
    )
    p.add_argument("--keep", type=Path, help="keep the load-test tool's reports in this directory")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="log the gateways' access lines (JSON) and split the quiet tenant's time to first "
        "byte into the gateway's wait and the engine's part",
    )
    args = p.parse_args(argv)
    if args.replicas > 1 and args.state != "redis":
        p.error("several replicas share their state in Redis: --state redis")
    quiet = RATES[args.scenario] * args.scale
    service = SERVICE_S / args.scale
    if args.calibrate:
        # The sim's steps take a little longer than asked (its loop's own overhead, more on
        # a loaded machine): measure one service time, and set the rates from it.
        service = calibrate(args.scale)
        quiet = SHARE_FRACTIONS[args.scenario] * 2 / service
    print(f"machine {machine()}, load average {loadavg()}")
    print(
        f"scenario {args.scenario}: quiet {quiet:g} req/s, flooder {quiet * FLOOD_FACTOR:g} "
        f"req/s, service ~{service:.3g} s, {args.state} x{args.replicas}, {args.seconds:g} s, "
        f"seed {args.seed}, overrides {args.sets or 'none'}"
    )
    runs: dict[str, dict[str, float]] = {}
    if args.scenario == "a":
        runs = {"alone": {"quiet": quiet}, "flooded": {"quiet": quiet, "flood": 10 * quiet}}
    elif args.scenario == "b":
        runs = {"partition": {"quiet": quiet}, "flooded": {"quiet": quiet, "flood": 10 * quiet}}
    else:
        runs = {
            "flood alone": {"flood": 10 * quiet},
            "with quiet": {"quiet": quiet, "flood": 10 * quiet},
        }
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="bench-fair-") as tmp:
        for name, rates in runs.items():
            blocks = (BLOCKS // 2) if name == "partition" else BLOCKS
            started = time.monotonic()
            with deployment(
                Path(tmp),
                blocks=blocks,
                state=args.state,
                replicas=args.replicas,
                scale=args.scale,
                sets=args.sets,
                access_log=args.breakdown,
            ) as (gws, pids):
                cpu_before = {k: cpu_seconds(p) or 0.0 for k, p in pids.items()}
                t0 = time.monotonic()
                report = run_load(gws, rates, args.seconds, args.seed, Path(tmp) / f"{name}.json")
                wall = time.monotonic() - t0
                cpu = {k: ((cpu_seconds(p) or 0.0) - cpu_before[k]) / wall for k, p in pids.items()}
            split = breakdown(access_records(gws, "quiet"), 0.1) if args.breakdown else None
            if args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                (args.keep / f"{args.scenario}-{name.replace(' ', '-')}.json").write_text(
                    json.dumps(report)
                )
                if args.breakdown:  # every tenant's access lines, for a timeline
                    lines = [r for t in rates for r in access_records(gws, t)]
                    stem = f"{args.scenario}-{name.replace(' ', '-')}"
                    (args.keep / f"{stem}-access.json").write_text(json.dumps(lines))
            figures = {t: tenant_figures(report, t, args.seconds) for t in rates}
            capacity = int((blocks - 1) * 0.95)
            figures["reserved_fraction"] = reserved_fraction(report, args.seconds, capacity)  # type: ignore[assignment]
            figures["cpu_cores"] = cpu  # type: ignore[assignment]
            results[name] = figures
            print(f"  {name} ({time.monotonic() - started:.0f} s):")
            for t in rates:
                f = figures[t]
                print(
                    f"    {t:6} sent {f['sent']:4} ok {f['ok']:4} not ok {f['not_ok'] or '-'}  "
                    f"wait p50 {f['wait_p50_s']:.3f} s  p95 {f['wait_p95_s']:.3f} s  "
                    f"e2e p50 {f['e2e_p50_s']:.3f} s  ok/s {f['ok_per_s']:.2f}"
                )
            print("    cpu (cores): " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()))
            if split is not None and split["n"]:
                figures["quiet_breakdown"] = split  # type: ignore[assignment]
                print(
                    f"    quiet, gateway side ({split['n']} answered): wait (line + admission) "
                    f"p50 {split['wait_50_s']:.3f} p95 {split['wait_95_s']:.3f} s; engine to "
                    f"first byte p50 {split['engine_50_s']:.3f} p95 {split['engine_95_s']:.3f} s"
                )
                print(
                    "    five longest first bytes (wait + engine): "
                    + ", ".join(f"{w['wait_s']:.3f}+{w['engine_s']:.3f}" for w in split["worst"])
                )
            if figures["reserved_fraction"] is not None:
                print(f"    engine reserved on average: {figures['reserved_fraction']:.1%}")
    quiet_runs = [n for n in runs if "quiet" in runs[n]]
    # One service time: the quiet tenant's median request alone (the sim's own overhead
    # makes it a little longer than the nominal SERVICE_S / scale).
    service = results[quiet_runs[0]]["quiet"]["e2e_p50_s"]
    results["service_s"] = service
    if args.scenario == "a":
        alone, flooded = (results[n]["quiet"]["wait_p95_s"] for n in quiet_runs)
        bound = 1.2 * alone + 0.3 * service
        verdict = "met" if flooded <= bound else "NOT met"
        print(
            f"(a) flooded p95 {flooded:.3f} s vs bound 1.2 x {alone:.3f} + 0.3 x "
            f"{service:.3g} = {bound:.3f} s: {verdict}"
        )
    elif args.scenario == "b":
        part, flooded = (results[n]["quiet"]["wait_p95_s"] for n in quiet_runs)
        bad = sum(results["flooded"]["quiet"]["not_ok"].values())
        verdict = "met" if flooded <= part and not bad else "NOT met"
        print(
            f"(b) flooded p95 {flooded:.3f} s vs static partition {part:.3f} s, "
            f"{bad} not ok: {verdict}"
        )
    print(f"load average at the end {loadavg()}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
