"""What the gateway costs: added latency, streaming time to first byte, request-rate ceiling.

    python benchmarks/bench_overhead.py [--requests 500] [--concurrency 32] [--seconds 5]
                                      [--rounds 3] [--client-procs 1] [--json out.json]
                                      [--profile gateway.txt]

One run starts, on 127.0.0.1, a fast simulated engine (`python -m gateway.sim`, zero step
times, so the engine is as cheap as it can be and not the thing measured) and `kv-gateway
serve` in front of it, each in its own process, and measures the same requests sent
(a) directly to the engine and (b) through the gateway:

* single-client latency of small non-streaming completions (p50, p99),
* single-client time to the first body byte of streaming completions (p50, p99),
* the request-rate ceiling: the completions per second that `--concurrency` closed-loop
  clients sustain for `--seconds`, after a one-second warm-up. The clients run in
  `--client-procs` worker processes, each with one pooled `httpx.AsyncClient`.

Single-client samples alternate direct / gateway request by request, so drift in the
machine's load falls on both alike. Rate windows alternate their order round by round.
During every rate window the CPU time of each process (client workers, gateway, engine) is
read from /proc, so the report says which process was the bottleneck — including the
client, which must stay below one core for the ceiling to be the server's.

Separate processes, not one event loop: in-process (as `kv-gateway demo` runs) the load
generator, the gateway and the engine would share one event loop and one GIL, and the
gateway's cost would be indistinguishable from the client's.

Bounded: a fixed number of single-client requests, fixed rate windows, per-request timeouts
and a watchdog (`--max-runtime-s`). Children are stopped on exit, on Ctrl-C and on SIGTERM;
on Linux they also receive SIGTERM if this process dies.

`--base REV` also runs the gateway of another commit (`git archive REV`, run from that tree
with `PYTHONPATH`) beside this tree's, against the same engine, in the same rounds: target
`base`, interleaved with `direct` and `gateway` request by request and window by window. The
report then gives this tree's CPU per request and latency as ratios to the base's, the figure
of record for "did this change make requests dearer" (absolute figures move by 1.4x between
sessions on these VMs; a ratio within one run does not).

`--profile FILE` adds one more rate window against the gateway with py-spy attached to it
(`--py-spy`, default: on PATH or /tmp/pyspy/bin/py-spy), writes the collapsed stacks to FILE
and prints the functions with the most on-CPU samples. That window is not in the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from gateway.harness import Child, GatewayProcess, SimProcess
from gateway.loadtest.cpu import cpu_seconds, loadavg, machine, machine_busy

MODEL = "tiny"
PROMPT = "Say hello in one short sentence."
TARGETS = ("direct", "gateway", "base")  # "base": the gateway of `--base REV`
# Large enough that neither the engine nor the gateway ever queues a request of this bench.
ENGINE = {"num_gpu_blocks": 65536, "block_size": 16, "max_num_seqs": 1024, "max_model_len": 2048}
WARMUP_REQUESTS = 50
RATE_WARMUP_S = 1.0
REQUEST_TIMEOUT_S = 30.0
STARTUP_TIMEOUT_S = 60.0


# ---------------------------------------------------------------------------------------------
# Request bodies


def request_body(api: str, *, stream: bool, max_tokens: int) -> tuple[str, bytes]:
    """(path, JSON body) of one small request; `ignore_eos` fixes the output length."""
    common: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True}
    if stream:
        common["stream"] = True
    if api == "chat":
        common["messages"] = [{"role": "user", "content": PROMPT}]
        return "/v1/chat/completions", json.dumps(common).encode()
    common["prompt"] = PROMPT
    return "/v1/completions", json.dumps(common).encode()


HEADERS = {"content-type": "application/json"}


# ---------------------------------------------------------------------------------------------
# Child processes


def start_engine(
    workdir: Path,
    engine: dict[str, int] = ENGINE,
    *,
    decode_ms: tuple[float, float] = (0.0, 0.0),
    prefill_ms_per_token: float = 0.0,
) -> tuple[Child, str]:
    """A simulated engine of that geometry (`decode_ms`: base and per-sequence step cost)."""
    sim = SimProcess(
        workdir=workdir,
        num_gpu_blocks=engine["num_gpu_blocks"],
        block_size=engine["block_size"],
        max_num_seqs=engine["max_num_seqs"],
        max_model_len=engine["max_model_len"],
        decode_ms_base=decode_ms[0],
        decode_ms_per_seq=decode_ms[1],
        prefill_ms_per_token=prefill_ms_per_token,
        own_group=True,  # Ctrl-C reaches only us; we stop the children in order
        startup_timeout_s=STARTUP_TIMEOUT_S,
    )
    return sim.start(), sim.url


def gateway_config(engine_url: str, tokenizer: str, redis_url: str | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "engines": [{"name": "sim", "url": engine_url, "models": [MODEL], **ENGINE}],
        "models": [{"name": MODEL, "tokenizer": tokenizer}],
        "queue": {"max_length": 4096, "max_wait_s": 30},
        "admission": {"kv_ceiling": 0.95},
    }
    if redis_url:  # a key prefix of its own: other users of that Redis are not touched
        cfg["redis"] = {"url": redis_url, "key_prefix": f"bench-{os.getpid()}"}
    return cfg


def start_gateway(
    workdir: Path, cfg: dict[str, Any], tree: Path | None = None
) -> tuple[Child, str]:
    """`kv-gateway serve` with that configuration; `tree`: run the package found there (a
    checkout of another commit) instead of the installed one."""
    env = None
    if tree is not None:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        workdir = workdir / "base-gateway"
        workdir.mkdir(exist_ok=True)
    gateway = GatewayProcess(
        cfg, workdir, startup_timeout_s=STARTUP_TIMEOUT_S, own_group=True, env=env
    )
    return gateway.start(), gateway.url


def base_tree(rev: str, workdir: Path) -> Path:
    """The files of commit `rev` of this repository, extracted under `workdir`."""
    repo = Path(__file__).resolve().parents[1]
    tree = workdir / "base-tree"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


# ---------------------------------------------------------------------------------------------
# Clients: a minimal keep-alive HTTP/1.1 client, and httpx for comparison


@dataclass(frozen=True)
class Timing:
    status: int
    first_byte_s: float  # until the first byte of the body
    total_s: float  # until the whole answer was read


class RawHttp:
    """One keep-alive HTTP/1.1 connection on asyncio streams: just enough client for this
    loopback benchmark (content-length and chunked answers, no redirects, no TLS). Its CPU
    cost per request is a small fraction of httpx's (see docs/benchmarks.md), so the load
    generator stays cheaper than the servers it measures."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, path: str, body: bytes) -> Timing:
        if self._streams is None:
            self._streams = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._streams
        start = time.perf_counter()
        writer.write(
            f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            status, length, chunked, close = _parse_head(head)
            if chunked:
                first = await _read_chunked(reader, start)
            else:
                await reader.readexactly(length)
                first = time.perf_counter() - start
        except BaseException:
            await self.aclose()
            raise
        total = time.perf_counter() - start
        if close:
            await self.aclose()
        return Timing(status, first, total)

    async def aclose(self) -> None:
        if self._streams is not None:
            writer = self._streams[1]
            self._streams = None
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def _parse_head(head: bytes) -> tuple[int, int, bool, bool]:
    """(status, content-length, chunked?, connection: close?) of a response head."""
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length, chunked, close = 0, False, False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value
        elif name == b"connection":
            close = value == b"close"
    return status, length, chunked, close


async def _read_chunked(reader: asyncio.StreamReader, start: float) -> float:
    """Read a chunked body to its end; returns the seconds from `start` to its first byte."""
    first: float | None = None
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if first is None:
            first = time.perf_counter() - start
        if size == 0:
            await reader.readuntil(b"\r\n")  # no trailers: the empty line that ends the body
            return first
        await reader.readexactly(size + 2)


class HttpxClient:
    """The same interface over a pooled `httpx.AsyncClient` (shared by all loops of a process)."""

    def __init__(self, base_url: str, client: httpx.AsyncClient) -> None:
        self.base_url = base_url
        self.client = client

    async def post(self, path: str, body: bytes) -> Timing:
        start = time.perf_counter()
        first: float | None = None
        request = self.client.build_request(
            "POST", self.base_url + path, content=body, headers=HEADERS
        )
        response = await self.client.send(request, stream=True)
        try:
            async for chunk in response.aiter_raw():
                if first is None and chunk:
                    first = time.perf_counter() - start
        finally:
            await response.aclose()
        total = time.perf_counter() - start
        return Timing(response.status_code, total if first is None else first, total)

    async def aclose(self) -> None:
        return None  # the pool is closed by its owner


Client = RawHttp | HttpxClient


@contextlib.asynccontextmanager
async def clients(kind: str, base_url: str, n: int) -> AsyncIterator[list[Client]]:
    """`n` clients of `base_url`: n raw connections, or n handles on one httpx pool of n."""
    if kind == "raw":
        raws = [RawHttp(base_url) for _ in range(n)]
        try:
            yield list(raws)
        finally:
            for c in raws:
                await c.aclose()
        return
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as pool:
        yield [HttpxClient(base_url, pool) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Single client: latency and time to first byte, direct and gateway alternating


async def checked(client: Client, path: str, body: bytes) -> Timing:
    async with asyncio.timeout(REQUEST_TIMEOUT_S):
        timing = await client.post(path, body)
    if timing.status != 200:
        raise RuntimeError(f"HTTP {timing.status} for {path}")
    return timing


async def paired_samples(
    kind: str, bases: dict[str, str], path: str, body: bytes, count: int
) -> dict[str, list[Timing]]:
    """`count` timings per target, one client per target, alternating target and first-mover
    pair by pair; a warm-up of WARMUP_REQUESTS per target is discarded."""
    samples: dict[str, list[Timing]] = {t: [] for t in bases}
    async with contextlib.AsyncExitStack() as stack:
        one = {
            t: (await stack.enter_async_context(clients(kind, u, 1)))[0] for t, u in bases.items()
        }
        for _ in range(WARMUP_REQUESTS):
            for t in bases:
                await checked(one[t], path, body)
        for i in range(count):
            for t in list(bases) if i % 2 == 0 else list(reversed(bases)):
                samples[t].append(await checked(one[t], path, body))
    return samples


# ---------------------------------------------------------------------------------------------
# Rate ceiling: closed-loop clients in worker processes, CPU of every process measured


@dataclass(frozen=True)
class WorkerResult:
    completed: int  # answers that ended inside the window
    errors: int
    latencies: list[float]  # of the answers inside the window, seconds


@dataclass(frozen=True)
class Load:
    kind: str  # "raw" | "httpx"
    base_url: str
    path: str
    body: bytes
    seconds: float


def rate_worker(load: Load, concurrency: int, ready: Any, go: Any, results: Any) -> None:
    """One load process: `concurrency` closed loops. Reports ready, waits for the window's
    start (a `time.monotonic` value, system-wide on Linux), runs the warm-up and the window,
    and puts a `WorkerResult` on `results`."""

    async def main(start: float) -> WorkerResult:
        window = (start + RATE_WARMUP_S, start + RATE_WARMUP_S + load.seconds)
        done: list[float] = []
        errors = 0

        async def loop(client: Client) -> None:
            nonlocal errors
            while time.monotonic() < window[1]:
                try:
                    async with asyncio.timeout(REQUEST_TIMEOUT_S):
                        timing = await client.post(load.path, load.body)
                    ok, took = timing.status == 200, timing.total_s
                except (OSError, TimeoutError, httpx.HTTPError, asyncio.IncompleteReadError):
                    ok, took = False, 0.0
                if window[0] <= time.monotonic() < window[1]:
                    if ok:
                        done.append(took)
                    else:
                        errors += 1

        async with clients(load.kind, load.base_url, concurrency) as loops:
            await asyncio.sleep(max(0.0, start - time.monotonic()))
            await asyncio.gather(*(loop(c) for c in loops))
        return WorkerResult(len(done), errors, done)

    ready.put(os.getpid())
    start = go.get(timeout=STARTUP_TIMEOUT_S)
    results.put(asyncio.run(main(start)))


@dataclass
class RateResult:
    target: str
    concurrency: int
    client_procs: int
    seconds: float
    rps: float
    errors: int
    p50_ms: float
    p99_ms: float
    # Share of one core used during the window, per process (1.0 = one full core).
    cpu: dict[str, float] = field(default_factory=dict)
    # Cores busy on the whole machine during the window (ours and everybody else's).
    machine_busy_cores: float | None = None
    loadavg: list[float] = field(default_factory=list)

    @property
    def cpu_ms_per_request(self) -> dict[str, float]:
        """CPU time each process spent per completed request: unlike req/s, it hardly
        depends on how much of the machine other jobs took."""
        if not self.rps:
            return {}
        return {k: 1e3 * v / self.rps for k, v in self.cpu.items()}

    @property
    def client_bound(self) -> bool:
        return any(v >= 0.85 for k, v in self.cpu.items() if k.startswith("client"))


def rate_window(
    target: str,
    load: Load,
    *,
    concurrency: int,
    procs: int,
    servers: dict[str, int],
    during: Callable[[], None] | None = None,
) -> RateResult:
    """Runs `procs` load processes for one window; `during()` is called when it begins."""
    ctx = mp.get_context("spawn")
    ready, go, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    shares = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    workers = [
        ctx.Process(target=rate_worker, args=(load, n, ready, go, results), daemon=True)
        for n in shares
    ]
    try:
        for w in workers:
            w.start()
        for _ in workers:
            ready.get(timeout=STARTUP_TIMEOUT_S)
        start = time.monotonic() + 0.2
        for _ in workers:
            go.put(start)
        pids = {**servers, **{f"client{i}": w.pid for i, w in enumerate(workers) if w.pid}}
        time.sleep(max(0.0, start + RATE_WARMUP_S - time.monotonic()))
        if during is not None:
            during()
        before = {k: cpu_seconds(p) for k, p in pids.items()}
        busy_before = machine_busy()
        t0 = time.monotonic()
        time.sleep(max(0.0, start + RATE_WARMUP_S + load.seconds - t0))
        after = {k: cpu_seconds(p) for k, p in pids.items()}
        busy_after = machine_busy()
        elapsed = time.monotonic() - t0
        parts = [results.get(timeout=REQUEST_TIMEOUT_S + load.seconds) for _ in workers]
    finally:
        for w in workers:
            w.join(timeout=REQUEST_TIMEOUT_S)
            if w.is_alive():
                w.terminate()
    cpu = {
        k: round((a - b) / elapsed, 3)
        for k in pids
        if (b := before[k]) is not None and (a := after[k]) is not None
    }
    latencies = [x for p in parts for x in p.latencies]
    busy = None
    if busy_before is not None and busy_after is not None:
        busy = round(
            (os.cpu_count() or 1)
            * (busy_after[0] - busy_before[0])
            / max(1e-9, busy_after[1] - busy_before[1]),
            2,
        )
    return RateResult(
        target=target,
        concurrency=concurrency,
        client_procs=procs,
        seconds=load.seconds,
        rps=sum(p.completed for p in parts) / load.seconds,
        errors=sum(p.errors for p in parts),
        p50_ms=percentile(latencies, 50) * 1e3,
        p99_ms=percentile(latencies, 99) * 1e3,
        cpu=cpu,
        machine_busy_cores=busy,
        loadavg=loadavg(),
    )


# ---------------------------------------------------------------------------------------------
# Profiling the gateway with py-spy


def find_py_spy(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    return shutil.which("py-spy") or (
        "/tmp/pyspy/bin/py-spy" if Path("/tmp/pyspy/bin/py-spy").exists() else None
    )


def hot_spots(
    collapsed: Path, top: int
) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
    """(samples, top frames by self samples, top frames by inclusive samples) of a py-spy
    `--format raw` file (one `frame;frame;... count` line per stack)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    return total, own.most_common(top), inclusive.most_common(top)


@contextlib.contextmanager
def py_spy_recording(
    binary: str, pid: int, out: Path, seconds: float
) -> Iterator[Callable[[], None]]:
    """Yields a `start()` to call when the load is warm; waits for py-spy on exit."""
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        cmd = [
            binary, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
            "--rate", "200", "--format", "raw", "--output", str(out), "--nonblocking",
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))

    try:
        yield start
    finally:
        for p in procs:
            try:
                _, err = p.communicate(timeout=seconds + 30)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if p.returncode != 0:
                print(f"py-spy failed ({p.returncode}): {err.decode(errors='replace')[-500:]}")


# ---------------------------------------------------------------------------------------------
# Figures


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no samples."""
    if not xs:
        return float("nan")
    ordered = sorted(xs)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def latency_summary(samples: list[float], blocks: int) -> dict[str, Any]:
    """p50/p99 in ms over all samples, and the p50 of each of `blocks` consecutive slices
    (their spread shows how stable the machine was)."""
    size = max(1, len(samples) // blocks)
    slices = [samples[i : i + size] for i in range(0, size * blocks, size)]
    return {
        "n": len(samples),
        "p50_ms": percentile(samples, 50) * 1e3,
        "p99_ms": percentile(samples, 99) * 1e3,
        "mean_ms": statistics.fmean(samples) * 1e3,
        "p50_ms_per_slice": [percentile(s, 50) * 1e3 for s in slices if s],
    }


def spread(values: list[float]) -> str:
    return f"{min(values):.3g}–{max(values):.3g}" if values else "-"


def print_latency(title: str, stats: dict[str, dict[str, Any]]) -> None:
    d, g = stats["direct"], stats["gateway"]
    print(f"\n{title} (n={d['n']} per target, one client)")
    print(f"  {'':8} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}   p50 per slice (ms)")
    for t in stats:
        s = stats[t]
        slices = " ".join(f"{x:.2f}" for x in s["p50_ms_per_slice"])
        print(f"  {t:8} {s['p50_ms']:8.2f} {s['p99_ms']:8.2f} {s['mean_ms']:8.2f}   {slices}")
    print(
        f"  added by the gateway: p50 +{g['p50_ms'] - d['p50_ms']:.2f} ms, "
        f"p99 +{g['p99_ms'] - d['p99_ms']:.2f} ms; ratio gateway/direct: "
        f"p50 {g['p50_ms'] / d['p50_ms']:.2f}x, p99 {g['p99_ms'] / d['p99_ms']:.2f}x"
    )
    b = stats.get("base")
    if b is not None:
        added, added_base = g["p50_ms"] - d["p50_ms"], b["p50_ms"] - d["p50_ms"]
        print(
            f"  this tree against the base: p50 {g['p50_ms'] / b['p50_ms']:.3f}x, "
            f"added p50 {added:.3f} ms against {added_base:.3f} ms"
        )


def print_rates(rates: list[RateResult]) -> dict[str, Any]:
    """Prints every window and, per concurrency level, the medians, spreads and ratios."""
    print(
        "\nrequest-rate ceiling (closed loop). cpu: share of one core per process; "
        "ms/req: its CPU time per request; busy: cores busy on the whole machine"
    )
    summary: dict[str, Any] = {}
    targets = [t for t in TARGETS if any(r.target == t for r in rates)]
    for conc in sorted({r.concurrency for r in rates}):
        per = {t: [r for r in rates if r.target == t and r.concurrency == conc] for t in targets}
        for t in targets:
            for r in per[t]:
                cpu = " ".join(
                    f"{k}={v:.2f} ({r.cpu_ms_per_request.get(k, 0):.2f})" for k, v in r.cpu.items()
                )
                flag = "  CLIENT-BOUND" if r.client_bound else ""
                print(
                    f"  c={conc:<4} {t:8} {r.rps:6.0f} req/s  p50 {r.p50_ms:6.1f} ms  "
                    f"p99 {r.p99_ms:6.1f} ms  err {r.errors}  cpu (ms/req) {cpu}  "
                    f"busy {r.machine_busy_cores}{flag}"
                )
        level: dict[str, Any] = {}
        for t in targets:
            rps = [r.rps for r in per[t]]
            level[t] = {"median_rps": statistics.median(rps), "rps": rps}
        gw_ms = [r.cpu_ms_per_request.get("gateway", 0) for r in per["gateway"]]
        eng_ms = [r.cpu_ms_per_request.get("engine", 0) for r in per["direct"]]
        level["gateway_cpu_ms_per_request"] = gw_ms
        level["engine_cpu_ms_per_request"] = eng_ms
        level["ratio"] = level["gateway"]["median_rps"] / level["direct"]["median_rps"]
        summary[str(conc)] = level
        print(
            f"  c={conc:<4} median direct {level['direct']['median_rps']:.0f} req/s "
            f"(spread {spread(level['direct']['rps'])}), gateway "
            f"{level['gateway']['median_rps']:.0f} req/s (spread {spread(level['gateway']['rps'])})"
            f"; ratio gateway/direct {level['ratio']:.2f}"
        )
        if gw_ms and eng_ms and min(gw_ms) > 0:
            g, e = statistics.median(gw_ms), statistics.median(eng_ms)
            print(
                f"         CPU per request: gateway {g:.2f} ms (spread {spread(gw_ms)}), "
                f"engine {e:.2f} ms (spread {spread(eng_ms)}): one core saturates at about "
                f"{1e3 / g:.0f} req/s for the gateway, {1e3 / e:.0f} req/s for the engine"
            )
        base_ms = [r.cpu_ms_per_request.get("gateway", 0) for r in per.get("base", [])]
        if base_ms and gw_ms and min(base_ms) > 0:
            pairs = [g / b for g, b in zip(gw_ms, base_ms, strict=False)]
            level["base_cpu_ms_per_request"] = base_ms
            level["cpu_ratio_to_base"] = statistics.median(gw_ms) / statistics.median(base_ms)
            level["cpu_ratio_to_base_by_round"] = pairs
            print(
                f"         this tree against the base: CPU per request "
                f"{level['cpu_ratio_to_base']:.3f}x (medians {statistics.median(gw_ms):.3f} / "
                f"{statistics.median(base_ms):.3f} ms; by round {spread(pairs)}), req/s "
                f"{level['gateway']['median_rps'] / level['base']['median_rps']:.3f}x"
            )
    return summary


# ---------------------------------------------------------------------------------------------
# The run


class Interrupted(Exception):
    pass


def _raise_interrupted(signum: int, _frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_overhead.py", description=__doc__.splitlines()[0] if __doc__ else None
    )
    p.add_argument("--requests", type=int, default=500, help="single-client samples per target")
    p.add_argument(
        "--concurrency",
        default="32",
        help="closed-loop clients of the rate windows; a comma list measures each (default 32)",
    )
    p.add_argument("--seconds", type=float, default=5.0, help="length of one rate window")
    p.add_argument("--rounds", type=int, default=3, help="rate windows per target and level")
    p.add_argument("--client-procs", type=int, default=1, help="load processes in rate windows")
    p.add_argument("--api", choices=["completion", "chat"], default="completion")
    p.add_argument(
        "--client",
        choices=["raw", "httpx"],
        default="raw",
        help="load generator: a minimal HTTP/1.1 client (default) or a pooled httpx client",
    )
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    p.add_argument(
        "--tokenizer", default="hf:@tiny", help="the gateway's token counter (default hf:@tiny)"
    )
    p.add_argument(
        "--redis", help="shared state in this Redis (e.g. redis://127.0.0.1:6379/0), not in-process"
    )
    p.add_argument(
        "--base",
        help="also run the gateway of this commit (e.g. facbfcd) in the same rounds: ratios to it",
    )
    p.add_argument("--json", type=Path, help="also write every figure to this file")
    p.add_argument("--profile", type=Path, help="py-spy collapsed stacks of the gateway here")
    p.add_argument("--py-spy", help="py-spy binary (default: PATH, then /tmp/pyspy/bin/py-spy)")
    p.add_argument("--max-runtime-s", type=int, default=900, help="watchdog for the whole run")
    args = p.parse_args(argv)
    args.levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if args.requests < 1 or args.rounds < 1 or args.client_procs < 1 or args.seconds <= 0:
        p.error("--requests, --rounds, --client-procs must be >= 1 and --seconds > 0")
    if any(c < args.client_procs for c in args.levels):
        p.error("every --concurrency level must be >= --client-procs")
    return args


def run(args: argparse.Namespace, workdir: Path, children: list[Child]) -> dict[str, Any]:
    report: dict[str, Any] = {"machine": machine(), "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
    }}  # fmt: skip
    report["loadavg_start"] = loadavg()
    print(f"machine: {report['machine']}; load average {report['loadavg_start']}")

    engine, engine_url = start_engine(workdir)
    children.append(engine)
    cfg = gateway_config(engine_url, args.tokenizer, args.redis)
    gateway, gateway_url = start_gateway(workdir, cfg)
    children.append(gateway)
    print(f"engine {engine_url} (pid {engine.pid}), gateway {gateway_url} (pid {gateway.pid})")
    bases = {"direct": engine_url, "gateway": gateway_url}
    pids = {"gateway": gateway.pid}
    if args.base:
        if args.redis:  # its own keys: the two gateways must not share a ledger
            cfg = {**cfg, "redis": {**cfg["redis"], "key_prefix": f"bench-base-{os.getpid()}"}}
        base, bases["base"] = start_gateway(workdir, cfg, base_tree(args.base, workdir))
        children.append(base)
        pids["base"] = base.pid
        print(f"base gateway ({args.base}) {bases['base']} (pid {base.pid})")
    targets = tuple(bases)

    path, body = request_body(args.api, stream=False, max_tokens=args.max_tokens)
    _, stream_body = request_body(args.api, stream=True, max_tokens=args.max_tokens)

    timings = asyncio.run(paired_samples(args.client, bases, path, body, args.requests))
    report["latency"] = {
        t: latency_summary([x.total_s for x in timings[t]], args.rounds) for t in targets
    }
    print_latency(
        f"non-streaming latency ({args.api}, {args.max_tokens} tokens, {args.client} client)",
        report["latency"],
    )
    timings = asyncio.run(paired_samples(args.client, bases, path, stream_body, args.requests))
    report["ttfb"] = {
        t: latency_summary([x.first_byte_s for x in timings[t]], args.rounds) for t in targets
    }
    print_latency("streaming time to first body byte", report["ttfb"])

    # The process measured as "gateway" in a window is the one that window's target runs.
    servers = {t: {"gateway": pids.get(t, gateway.pid), "engine": engine.pid} for t in targets}
    loads = {t: Load(args.client, bases[t], path, body, args.seconds) for t in targets}
    rates: list[RateResult] = []
    for level in args.levels:
        for r in range(args.rounds):
            for t in targets if r % 2 == 0 else tuple(reversed(targets)):
                rates.append(
                    rate_window(
                        t, loads[t], concurrency=level, procs=args.client_procs, servers=servers[t]
                    )
                )
                print(f"  . c={level} {t} round {r + 1}: {rates[-1].rps:.0f} req/s", flush=True)
    report["rate"] = [asdict(r) for r in rates]
    report["rate_summary"] = print_rates(rates)
    if any(r.client_bound for r in rates):
        print("  note: a client process used >= 85% of a core: the ceiling may be the client's")

    if args.profile is not None:
        report["profile"] = profile(args, loads["gateway"], servers["gateway"])
    report["loadavg_end"] = loadavg()
    print(f"\nload average at the end {report['loadavg_end']}")
    return report


def profile(args: argparse.Namespace, load: Load, servers: dict[str, int]) -> dict[str, Any]:
    binary = find_py_spy(args.py_spy)
    if binary is None:
        print("py-spy not found: pip install py-spy into a separate venv, pass --py-spy")
        return {}
    level = max(args.levels)
    with py_spy_recording(binary, servers["gateway"], args.profile, args.seconds) as start:
        rate = rate_window(
            "gateway", load, concurrency=level, procs=args.client_procs, servers=servers,
            during=start,
        )  # fmt: skip
    print(f"\nprofiled window: gateway {rate.rps:.0f} req/s under py-spy, cpu {rate.cpu}")
    if not args.profile.exists():
        return {}
    total, own, inclusive = hot_spots(args.profile, 20)
    print(f"gateway on-CPU samples: {total} (collapsed stacks in {args.profile})")
    print("  top self:")
    for frame, n in own:
        print(f"    {100 * n / total:5.1f}%  {frame}")
    print("  top inclusive:")
    for frame, n in inclusive:
        print(f"    {100 * n / total:5.1f}%  {frame}")
    return {"samples": total, "self": own, "inclusive": inclusive, "rps": rate.rps}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGINT explicitly too: a shell starts background jobs with SIGINT ignored.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM):
        signal.signal(sig, _raise_interrupted)
    signal.alarm(args.max_runtime_s)
    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        try:
            report = run(args, Path(tmp), children)
        except (KeyboardInterrupt, Interrupted) as e:
            print(f"\nstopped ({type(e).__name__} {e}); cleaning up", file=sys.stderr)
            return 130
        finally:
            signal.alarm(0)
            for child in reversed(children):  # the gateway first, then its engine
                child.stop()
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
