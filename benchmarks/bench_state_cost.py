"""What shared state costs: CPU per request with Redis state against in-process, same run.

    .venv/bin/python benchmarks/bench_state_cost.py [--rounds 3] [--seconds 5]
                                                    [--concurrency 32] [--workers 1,2]

One run starts a zero-cost simulated engine, a private `redis-server` on a free port, and
two `kv-gateway serve` processes in front of the engine: one with in-process state, one
with its state in that Redis. Closed-loop rate windows (`benchmarks/bench_overhead.py`'s
load processes and /proc accounting) alternate between the two, round by round, so drift in
the machine's load falls on both alike. It prints, per window and as medians:

* req/s, and the CPU time per request of the gateway and — for the Redis target — of
  `redis-server`: the cost of shared state is the Redis gateway's CPU plus redis-server's
  against the in-process gateway's (the issue 18 target: at most 1.3x);
* with `--commandstats`, for each Redis window the commands redis-server ran per request and
  the time they took inside it (`INFO commandstats`), against its whole CPU per request:
  the rest is its event loop (reading, parsing, replying);
* with `--workers N,...`, the same for `kv-gateway serve --workers N` with Redis state (the
  CPU of the supervisor and all its workers together), to say what each worker adds.

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_overhead import (
    Load,
    RateResult,
    gateway_config,
    rate_window,
    request_body,
    start_engine,
)

from gateway.harness import Child, GatewayProcess, RedisServer
from gateway.loadtest.cpu import loadavg, machine


def gateway_pids(gateway: Child) -> list[int]:
    """The gateway process and, under `--workers`, its worker processes."""
    pid = gateway.pid
    if pid is None:
        return []
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    return pids + [int(c) for c in children]


def window(target: str, load: Load, level: int, servers: dict[str, int]) -> RateResult:
    return rate_window(target, load, concurrency=level, procs=1, servers=servers)


def per_request(result: RateResult, prefixes: tuple[str, ...]) -> float:
    """CPU ms per request of the processes whose names start with one of `prefixes`."""
    return sum(v for k, v in result.cpu_ms_per_request.items() if k.startswith(prefixes))


def commandstats(url: str) -> dict[str, tuple[int, int]]:
    """redis-server's `INFO commandstats`: command -> (calls, usec inside it)."""
    import redis as redis_py

    with redis_py.Redis.from_url(url) as client:
        info = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): (v["calls"], v["usec"]) for k, v in info.items()}


def print_commands(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], requests: int
) -> None:
    """Per request: each command's calls and µs inside redis-server, the busiest first. A
    script call's µs (FCALL, EVALSHA) include those of the commands it runs, which are
    listed too: the time in scripts is the first figure, not the sum of the rows."""
    rows = []
    for name, (calls, usec) in after.items():
        c0, u0 = before.get(name, (0, 0))
        if calls > c0:
            rows.append((usec - u0, calls - c0, name))
    scripts = sum(r[0] for r in rows if r[2] in ("fcall", "evalsha"))
    n = max(1, requests)
    print(f"      in scripts (their commands included): {scripts / n:.1f} µs/req", flush=True)
    for usec, calls, name in sorted(rows, reverse=True)[:8]:
        print(
            f"        {name:18} {calls / n:5.2f} calls/req  {usec / n:6.1f} µs/req  "
            f"{usec / max(1, calls):6.1f} µs/call",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_state_cost.py", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--tokenizer", default="hf:@tiny")
    p.add_argument("--workers", default="", help="also measure `serve --workers N` (comma list)")
    p.add_argument(
        "--commandstats", action="store_true", help="redis-server's commands per request"
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",") if w.strip()]
    report: dict[str, Any] = {"machine": machine(), "loadavg_start": loadavg()}
    print(f"machine: {report['machine']}; load average {report['loadavg_start']}")
    children: list[Child] = []
    redis = RedisServer().start()
    with tempfile.TemporaryDirectory(prefix="bench-state-") as tmp:
        workdir = Path(tmp)
        try:
            engine, engine_url = start_engine(workdir)
            children.append(engine)
            targets: dict[str, tuple[Child, list[str]]] = {}
            plain = gateway_config(engine_url, args.tokenizer, None)
            shared = gateway_config(engine_url, args.tokenizer, redis.url)
            for name, cfg, extra in (
                ("in-process", plain, []),
                ("redis", shared, []),
                *((f"redis-w{n}", shared, ["--workers", str(n)]) for n in workers),
            ):
                gw = GatewayProcess(cfg, workdir, args=extra, own_group=True)
                children.append(gw.start())
                targets[name] = (gw, extra)
            path, body = request_body("completion", stream=False, max_tokens=8)
            results: list[RateResult] = []
            names = list(targets)
            for r in range(args.rounds):
                for name in names if r % 2 == 0 else list(reversed(names)):
                    gw, _ = targets[name]
                    servers = {f"gateway{i}": pid for i, pid in enumerate(gateway_pids(gw))}
                    if name.startswith("redis") and redis.proc is not None:
                        servers["redis-server"] = redis.proc.pid
                    servers["engine"] = engine.pid or 0
                    load = Load("raw", gw.url, path, body, args.seconds)
                    watch = args.commandstats and name.startswith("redis")
                    before = commandstats(redis.url) if watch else {}
                    res = window(name, load, args.concurrency, servers)
                    after = commandstats(redis.url) if watch else {}
                    results.append(res)
                    gw_ms = per_request(res, ("gateway",))
                    rs_ms = per_request(res, ("redis-server",))
                    print(
                        f"  round {r + 1} {name:11} {res.rps:6.0f} req/s  gateway "
                        f"{gw_ms:.3f} ms/req  redis-server {rs_ms:.3f} ms/req  "
                        f"err {res.errors}  busy {res.machine_busy_cores}",
                        flush=True,
                    )
                    if watch:
                        print_commands(before, after, round(res.rps * res.seconds))
        finally:
            for child in reversed(children):
                child.stop()
            redis.stop()
    summary: dict[str, Any] = {}
    for name in names:
        mine = [r for r in results if r.target == name]
        summary[name] = {
            "rps": statistics.median(r.rps for r in mine),
            "gateway_ms": statistics.median(per_request(r, ("gateway",)) for r in mine),
            "redis_server_ms": statistics.median(per_request(r, ("redis-server",)) for r in mine),
        }
    base = summary["in-process"]["gateway_ms"]
    print("\nmedians:")
    for name, s in summary.items():
        total = s["gateway_ms"] + s["redis_server_ms"]
        s["total_ms"] = total
        s["vs_in_process"] = total / base if base else None
        print(
            f"  {name:11} {s['rps']:6.0f} req/s  gateway {s['gateway_ms']:.3f} + redis-server "
            f"{s['redis_server_ms']:.3f} = {total:.3f} ms/req  ({total / base:.2f}x in-process)"
        )
    report["summary"] = summary
    report["windows"] = [asdict(r) for r in results]
    report["loadavg_end"] = loadavg()
    print(f"load average at the end {report['loadavg_end']}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
