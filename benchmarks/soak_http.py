"""A soak through the gateway over HTTP: does its memory level off under sustained load?

    python benchmarks/soak_http.py [--store memory|redis] [--warmup 50000] [--requests 500000]
                                   [--max-seconds 7200] [--concurrency 24] [--sample-s 5]
                                   [--json out.json]

One run starts, on 127.0.0.1, two simulated engines (`python -m gateway.sim`, small and fast:
requests wait and are refused sometimes), `kv-gateway serve` in front of them (in-process
state, or a private `redis-server` with `--store redis`; `--redis URL` uses another) and one
load process (aiohttp, `--concurrency` closed loops). The load is a mix that exercises every
per-request, per-tenant and per-engine structure of the gateway:

* four tenants: one unlimited (weight 2), one with `rpm`, one with `max_concurrency` 4, one
  with `tpm` — so some requests are refused (429), some wait in the line and some time out;
* chat completions (a shared system prompt, distinct user text), completions (distinct
  prompts) and, for `RESPONSES_SHARE` (40 %) of the requests, Responses API requests
  (`/v1/responses`: the same instructions and distinct input; a quarter of them continue the
  last plain answer their loop got, by `previous_response_id`, which the gateway routes to
  the engine that stored it); `max_tokens` (`max_output_tokens`) 4-32, half of them streamed;
* 10 % cancelled by the client (a stream left after its first events, an answer not waited
  for), 2 % bad requests (a body that is not JSON: 400; an unknown model: 404).

The gateway's bounded caches are made small, or fed enough, so that they are full by the end
of the warm-up: `prefix_cache.index_entries` 4096, checked at `/admin/status` (the engines'
prefix index entries at the end of the warm-up and at the end); the output-length samples, a
window of `reservation.window` requests (1,000); the Responses API's id log
(`gateway/stored_responses.py`, the last `MAX_STORED` = 10,000 answers the gateway relayed to
their end), read at `/admin/status` (`process.stored_responses`) beside the Responses answers
the load read to their end with status 200: about two thirds of the Responses requests are
read in full (the others are refused, cancelled or bad), so it is full after about 38,000
requests (2026-12-08: 13,184 answers read by 50,552 requests).

The gateway's resident memory (`/proc/PID/statm`) is sampled every `--sample-s` with the
number of requests ended so far. After `--warmup` requests, the next `--requests` (or
`--max-seconds`) are the measured phase; the report gives the RSS growth over it and the
least-squares slope of RSS against requests over its last half, with a 95 % interval, in
bytes per request. At the end the load stops and the run checks that nothing is left
reserved or queued (`/admin/status`: every engine's reserved blocks and sequences, the
queue). Bounded: the request count and `--max-seconds`, a watchdog, children stopped on exit.
Only loopback addresses.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import multiprocessing as mp
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from gateway.harness import Child, GatewayProcess, RedisServer, SimProcess
from gateway.loadtest.cpu import loadavg, machine

MODEL = "tiny"
ADMIN_KEY = "soak-admin"
TENANT_KEYS = {"free": "soak-free", "rpm": "soak-rpm", "conc": "soak-conc", "tpm": "soak-tpm"}
INDEX_ENTRIES = 4096
SYSTEM = "You are a careful assistant. Answer in one short sentence, plainly. " * 4
RESPONSES_SHARE = 0.4  # of the mix: enough answers to fill the id log within the warm-up
FOLLOW_UP_SHARE = 0.25  # of those: continue the loop's last plain answer (previous_response_id)
ENGINE = dict(
    num_gpu_blocks=512,
    block_size=16,
    max_num_seqs=16,
    max_model_len=2048,
    decode_ms_base=1.0,
    decode_ms_per_seq=0.02,
    prefill_ms_per_token=0.0,
)


def digest(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def gateway_config(engines: list[str], redis_url: str | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "engines": [{"url": url} for url in engines],
        "models": [{"name": MODEL, "tokenizer": "hf:@tiny"}],
        "tenants": [
            {"name": "free", "api_keys": [digest(TENANT_KEYS["free"])], "weight": 2},
            {"name": "rpm", "api_keys": [digest(TENANT_KEYS["rpm"])], "rpm": 6000},
            {"name": "conc", "api_keys": [digest(TENANT_KEYS["conc"])], "max_concurrency": 4},
            {"name": "tpm", "api_keys": [digest(TENANT_KEYS["tpm"])], "tpm": 200000},
        ],
        "admin": {"api_keys": [digest(ADMIN_KEY)]},
        "queue": {"max_length": 16, "max_wait_s": 0.5},
        "prefix_cache": {"index_entries": INDEX_ENTRIES},
        "health": {"scrape_interval_s": 1.0},
    }
    if redis_url:
        cfg["redis"] = {"url": redis_url, "key_prefix": f"soak-{os.getpid()}"}
    return cfg


# ---------------------------------------------------------------------------------------------
# The load process


def one_request(
    rng: random.Random, previous: str | None = None
) -> tuple[str, str, bytes, bool, bool]:
    """(tenant key, path, body, stream, cancel) of one request of the mix; `previous`: the
    id of a Responses answer a Responses request may continue."""
    key = TENANT_KEYS[rng.choice(("free", "free", "rpm", "conc", "tpm"))]
    stream = rng.random() < 0.5
    cancel = rng.random() < 0.1
    words = " ".join(f"w{rng.randrange(1_000_000)}" for _ in range(rng.randrange(8, 80)))
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randrange(4, 33), "stream": stream}
    bad = rng.random()
    kind = rng.random()
    if kind < RESPONSES_SHARE:
        path = "/v1/responses"
        body["max_output_tokens"] = body.pop("max_tokens")
        body["input"] = words
        if previous is not None and rng.random() < FOLLOW_UP_SHARE:
            body["previous_response_id"] = previous
        else:
            body["instructions"] = SYSTEM
    elif kind < (1 + RESPONSES_SHARE) / 2:
        path = "/v1/chat/completions"
        body["messages"] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": words},
        ]
    else:
        path = "/v1/completions"
        body["prompt"] = words
    if bad < 0.01:
        return key, path, b'{"model": "tiny", "prompt": ', False, False  # not JSON: 400
    if bad < 0.02:
        body["model"] = "no-such-model"  # 404
    return key, path, json.dumps(body).encode(), stream, cancel


def response_id(answer: bytes, stream: bool) -> str | None:
    """The id of a whole Responses answer: its body's, or its first event's (`response.created`)."""
    try:
        if not stream:
            found = json.loads(answer).get("id")
        else:
            first = answer.split(b"\n\n", 1)[0]
            data = next(line for line in first.split(b"\n") if line.startswith(b"data:"))
            found = json.loads(data[5:])["response"]["id"]
    except (ValueError, KeyError, StopIteration, AttributeError, TypeError):
        return None
    return found if isinstance(found, str) and found.startswith("resp_") else None


async def _send(
    http: Any, url: str, rng: random.Random, outcomes: Counter[str], previous: str | None
) -> tuple[bool, str | None]:
    """One request of the mix: whether it was a Responses answer read in full with 200 (an id
    the gateway's log remembered), and that id when the request did not continue another (for
    the loop to continue later)."""
    import aiohttp  # the load process only

    key, path, body, stream, cancel = one_request(rng, previous)
    # A continuation, unless it is one of the bad requests (an unknown model: 404).
    follow_up = b'"previous_response_id"' in body and b"no-such-model" not in body
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    try:
        if cancel and not stream:
            try:
                async with asyncio.timeout(0.002):
                    async with http.post(url + path, data=body, headers=headers) as r:
                        await r.read()
                outcomes[str(r.status)] += 1
            except TimeoutError:
                outcomes["cancelled"] += 1
            return False, None
        async with http.post(url + path, data=body, headers=headers) as r:
            if stream and cancel and r.status == 200:
                async for _ in r.content:
                    break  # gone after the first event
                outcomes["cancelled"] += 1
                return False, None
            answer = await r.read()
            outcomes[str(r.status)] += 1
            if follow_up:
                outcomes[f"follow_up {r.status}"] += 1
            if path != "/v1/responses" or r.status != 200:
                return False, None
            found = response_id(answer, stream)
            if found is None:
                outcomes["responses without id"] += 1
                return False, None
            outcomes["responses read"] += 1
            return True, None if follow_up else found
    except (aiohttp.ClientError, OSError) as exc:
        outcomes[type(exc).__name__] += 1
    return False, None


def load_process(
    url: str, concurrency: int, total: int, seed: int, done: Any, stop: Any, answered: Any
) -> None:
    """`concurrency` closed loops until `total` requests have ended or `stop` is set;
    `done` counts the requests ended, `answered` the Responses answers read in full (200).
    Prints the outcomes at the end."""
    import aiohttp

    async def main() -> Counter[str]:
        outcomes: Counter[str] = Counter()
        started = 0
        connector = aiohttp.TCPConnector(limit=concurrency * 2)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

            async def loop(i: int) -> None:
                nonlocal started
                rng = random.Random(seed * 1000 + i)
                previous: str | None = None
                while started < total and not stop.is_set():
                    started += 1
                    read, found = await _send(http, url, rng, outcomes, previous)
                    previous = found or previous
                    if read:
                        with answered.get_lock():
                            answered.value += 1
                    with done.get_lock():
                        done.value += 1

            await asyncio.gather(*(loop(i) for i in range(concurrency)))
        return outcomes

    outcomes = asyncio.run(main())
    print("load outcomes:", dict(sorted(outcomes.items())), flush=True)


# ---------------------------------------------------------------------------------------------
# Figures


def rss_bytes(pid: int) -> int:
    pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def slope(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope of y on x and the half-width of its 95 % interval (normal
    approximation; the runs take hundreds of samples)."""
    n = len(points)
    if n < 3:
        return float("nan"), float("nan")
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return float("nan"), float("nan")
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    a = my - b * mx
    resid = sum((y - (a + b * x)) ** 2 for x, y in points)
    se = math.sqrt(resid / (n - 2) / sxx)
    return b, 1.96 * se


def status(url: str) -> dict[str, Any]:
    got = httpx.get(url + "/admin/status", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    got.raise_for_status()
    body: dict[str, Any] = got.json()
    return body


def index_entries(snap: dict[str, Any]) -> int:
    return sum((e.get("prefix_index") or {}).get("blocks", 0) for e in snap["engines"])


def stored_responses(snap: dict[str, Any], answered: int) -> dict[str, int]:
    """The gateway's Responses id log as `/admin/status` shows it, and the Responses answers
    the load read in full (each one an id it remembered)."""
    log = snap["process"]["stored_responses"]
    return {"answered": answered, "entries": log["entries"], "max": log["max"]}


def leftovers(snap: dict[str, Any]) -> dict[str, int]:
    return {
        "reserved_blocks": sum(e["reserved_blocks"] for e in snap["engines"]),
        "reserved_seqs": sum(e["reserved_seqs"] for e in snap["engines"]),
        "queued": snap["queue"]["length"],
    }


# ---------------------------------------------------------------------------------------------
# The run


def run(args: argparse.Namespace, workdir: Path, children: list[Any]) -> dict[str, Any]:
    given = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report: dict[str, Any] = {"machine": machine(), "store": args.store, "args": given}
    print(f"machine: {report['machine']}; load average {loadavg()}", flush=True)
    sims = [SimProcess(workdir=workdir, own_group=True, **ENGINE) for _ in range(2)]
    for sim in sims:
        children.append(sim.start())
    redis_url = args.redis
    if args.store == "redis" and redis_url is None:
        server = RedisServer().start()
        children.append(server)
        redis_url = server.url
    cfg = gateway_config([s.url for s in sims], redis_url if args.store == "redis" else None)
    env = dict(os.environ, **dict(kv.split("=", 1) for kv in args.gateway_env))
    gateway = GatewayProcess(cfg, workdir, own_group=True, admin_key=ADMIN_KEY, env=env)
    children.append(gateway.start())
    assert gateway.pid is not None
    print(f"gateway {gateway.url} (pid {gateway.pid}), store {args.store}", flush=True)

    ctx = mp.get_context("spawn")
    done, stop, answered = ctx.Value("q", 0), ctx.Event(), ctx.Value("q", 0)
    total = args.warmup + args.requests
    load = ctx.Process(
        target=load_process,
        args=(gateway.url, args.concurrency, total, args.seed, done, stop, answered),
        daemon=True,
    )
    load.start()
    samples: list[tuple[float, int, int]] = []  # (seconds, requests ended, RSS bytes)
    start = time.monotonic()
    warm: dict[str, Any] | None = None
    deadline = None
    try:
        while load.is_alive():
            time.sleep(args.sample_s)
            now, count = time.monotonic() - start, done.value
            samples.append((now, count, rss_bytes(gateway.pid)))
            if warm is None and count >= args.warmup:
                snap = status(gateway.url)
                warm = {"at_s": now, "requests": count, "rss": samples[-1][2]}
                warm["index_entries"] = index_entries(snap)
                warm["stored_responses"] = stored_responses(snap, answered.value)
                deadline = now + args.max_seconds
                print(f"warm-up done: {warm}", flush=True)
            elif len(samples) % 12 == 0:
                print(
                    f"  t={now:7.0f} s  {count:8d} requests  RSS {samples[-1][2] / 2**20:.2f} MiB"
                )
            if deadline is not None and now > deadline:
                stop.set()
    finally:
        stop.set()
        load.join(timeout=90)
    if warm is None:
        raise RuntimeError("the warm-up did not finish")
    time.sleep(3)  # leases of cancelled requests: released when their upstream closes
    snap = status(gateway.url)
    end = {"requests": done.value, "rss": rss_bytes(gateway.pid)}
    measured = [(float(c), float(r)) for _, c, r in samples if c >= warm["requests"]]
    half = [p for p in measured if p[0] >= (warm["requests"] + end["requests"]) / 2]
    b_all, ci_all = slope(measured)
    b_half, ci_half = slope(half)
    report.update(
        warm=warm,
        end=end,
        growth_bytes=end["rss"] - warm["rss"],
        measured_requests=end["requests"] - warm["requests"],
        seconds=samples[-1][0],
        slope_bytes_per_request={"all": [b_all, ci_all], "last_half": [b_half, ci_half]},
        index_entries_end=index_entries(snap),
        stored_responses_end=stored_responses(snap, answered.value),
        leftovers=leftovers(snap),
        samples=samples,
    )
    print(
        f"\nmeasured: {report['measured_requests']} requests after a warm-up of "
        f"{warm['requests']} in {report['seconds']:.0f} s ({args.store} state)\n"
        f"RSS {warm['rss'] / 2**20:.2f} MiB at the end of the warm-up, "
        f"{end['rss'] / 2**20:.2f} MiB at the end: "
        f"growth {report['growth_bytes'] / 2**10:+.0f} KiB\n"
        f"slope of RSS on requests, last half: {b_half:+.3f} ± {ci_half:.3f} B/request "
        f"(upper end {b_half + ci_half:+.3f}); whole measured phase {b_all:+.3f} ± {ci_all:.3f}\n"
        f"prefix index entries: {warm['index_entries']} at the end of the warm-up, "
        f"{report['index_entries_end']} at the end (bound: {INDEX_ENTRIES} in all, at most "
        f"each engine's usable blocks there)\n"
        f"Responses id log: {_log_line(warm['stored_responses'])} at the end of the warm-up, "
        f"{_log_line(report['stored_responses_end'])} at the end\n"
        f"left after the load: {report['leftovers']}"
    )
    return report


def _log_line(log: dict[str, int]) -> str:
    full = "full" if log["entries"] >= log["max"] else "not full"
    return f"{log['entries']}/{log['max']} entries ({full}; {log['answered']} answers read)"


def _stop(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="soak_http.py", description=__doc__.splitlines()[0])
    p.add_argument("--store", choices=["memory", "redis"], default="memory")
    p.add_argument("--redis", help="a Redis to use (default: a private redis-server)")
    p.add_argument("--warmup", type=int, default=50_000, help="requests before measuring")
    p.add_argument("--requests", type=int, default=500_000, help="requests measured")
    p.add_argument("--max-seconds", type=float, default=7200.0, help="cap of the measured phase")
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--gateway-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the gateway process (e.g. MALLOC_ARENA_MAX=2)",
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGALRM):
        signal.signal(sig, _stop)
    signal.alarm(int(args.max_seconds + 3600))
    children: list[Child | RedisServer] = []
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        try:
            report = run(args, Path(tmp), children)
        except KeyboardInterrupt as e:
            print(f"\nstopped ({e}); cleaning up", file=sys.stderr)
            return 130
        finally:
            signal.alarm(0)
            for child in reversed(children):
                child.stop()
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
