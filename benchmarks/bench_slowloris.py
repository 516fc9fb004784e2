"""What a slowloris costs the gateway: connections, memory, CPU — and what it costs clients.

    .venv/bin/python benchmarks/bench_slowloris.py [--connections 1000] [--body-connections 200]
                                                  [--header-timeout-s 10] [--body-timeout-s 60]
                                                  [--max-connections 1000] [--per-address N]
                                                  [--hold-s 25] [--head-kib 0] [--no-limits]

Starts, on 127.0.0.1, a simulated engine and `kv-gateway serve` (its listener with the
configured `clients:` limits), then, from this process:

1. **slow headers**: opens `--connections` connections that each send a partial request and
   then one more header byte every second (the classic slowloris), for `--hold-s` seconds;
2. **slow bodies**: opens `--body-connections` connections that send complete headers
   (`content-length: 100000`) and then one body byte a second.

`--head-kib N` adds about N KiB of headers (15 KiB each, within the default per-header limit)
to what every attacker sends first: the most a request head may hold is `max_head_bytes`.

The attackers connect from 127.0.0.1; meanwhile a legitimate client, from 127.0.0.2 (another
client address, for `--per-address`), sends one small completion every 0.5 s, each on a new
connection. For each phase it
prints: connections accepted / refused (503) / cut off (408, or closed) and when, the
gateway's resident memory before and at the peak (VmRSS, /proc) and per held connection, the
gateway's CPU time over the phase, and the legitimate requests' latencies and failures.
Prints figures; asserts nothing. `--no-limits` leaves `clients:` out of the config, for a
gateway without these limits (an older checkout first on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from gateway.harness import GatewayProcess, SimProcess

TICKS = os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


class Attacker:
    """One slow connection: what it got back, and when."""

    def __init__(self) -> None:
        self.outcome = "open"  # open | refused | 408 | closed | failed
        self.ended_after: float | None = None

    async def run(self, host: str, port: int, first: bytes, drip: bytes, hold_s: float) -> None:
        started = time.monotonic()
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            self.outcome = "failed"
            return
        try:
            writer.write(first)
            while time.monotonic() - started < hold_s:
                try:
                    answer = await asyncio.wait_for(reader.read(64), timeout=1.0)
                except TimeoutError:
                    writer.write(drip)
                    continue
                self.ended_after = time.monotonic() - started
                if answer.startswith(b"HTTP/1.1 503"):
                    self.outcome = "refused"
                elif answer.startswith(b"HTTP/1.1 408"):
                    self.outcome = "408"
                else:
                    self.outcome = "closed"
                return
        except OSError:
            self.outcome, self.ended_after = "closed", time.monotonic() - started
        finally:
            writer.close()


async def legit_client(url: str, stop: asyncio.Event) -> tuple[list[float], int]:
    latencies, failures = [], 0
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
    # A new connection per request, as a new client's: it needs a free connection slot.
    transport = httpx.AsyncHTTPTransport(
        local_address="127.0.0.2", limits=httpx.Limits(max_keepalive_connections=0)
    )
    async with httpx.AsyncClient(timeout=30, transport=transport) as http:
        while not stop.is_set():
            started = time.monotonic()
            try:
                r = await http.post(url + "/v1/completions", json=body)
                if r.status_code == 200:
                    latencies.append(time.monotonic() - started)
                else:
                    failures += 1
            except httpx.HTTPError:
                failures += 1
            await asyncio.sleep(0.5)
    return latencies, failures


async def phase(
    name: str, gateway: GatewayProcess, n: int, first: bytes, drip: bytes, hold_s: float
) -> None:
    pid = gateway.pid
    assert pid is not None
    if n == 0:
        return
    rss_before, cpu_before = rss_kib(pid), cpu_s(pid)
    stop = asyncio.Event()
    legit = asyncio.create_task(legit_client(gateway.url, stop))
    attackers = [Attacker() for _ in range(n)]
    tasks = []
    for a in attackers:  # 200 new connections a second, as a patient attacker would
        tasks.append(asyncio.create_task(a.run("127.0.0.1", gateway.port, first, drip, hold_s)))
        await asyncio.sleep(0.005)
    peak_rss, peak_open, started = rss_before, 0, time.monotonic()
    while not all(t.done() for t in tasks):
        peak_rss = max(peak_rss, rss_kib(pid))
        peak_open = max(peak_open, sum(a.outcome == "open" for a in attackers))
        await asyncio.sleep(0.2)
    stop.set()
    latencies, failures = await legit
    cpu = cpu_s(pid) - cpu_before
    wall = time.monotonic() - started
    outcomes: dict[str, int] = {}
    for a in attackers:
        outcomes[a.outcome] = outcomes.get(a.outcome, 0) + 1
    ends = sorted(a.ended_after for a in attackers if a.ended_after is not None)
    held = max(1, peak_open)
    print(f"\n{name}: {n} connections, held up to {hold_s:g} s each")
    print(f"  outcomes: {dict(sorted(outcomes.items()))}")
    if ends:
        print(
            f"  ended after: min {ends[0]:.1f} s, median {statistics.median(ends):.1f} s,"
            f" max {ends[-1]:.1f} s"
        )
    print(
        f"  gateway RSS: {rss_before / 1024:.1f} MiB before, {peak_rss / 1024:.1f} MiB peak"
        f" (+{(peak_rss - rss_before) / held:.1f} KiB per connection held,"
        f" {peak_open} held at once)"
    )
    print(
        f"  gateway CPU: {cpu:.2f} s over {wall:.1f} s ({100 * cpu / wall:.1f} % of a core;"
        f" {1000 * cpu / n:.2f} ms per attacking connection)"
    )
    if latencies:
        ms = sorted(1000 * x for x in latencies)
        print(
            f"  legitimate requests: {len(ms)} ok, {failures} failed;"
            f" p50 {statistics.median(ms):.1f} ms, max {ms[-1]:.1f} ms"
        )
    else:
        print(f"  legitimate requests: none ok, {failures} failed")


def padding(size: int) -> bytes:
    """Header lines of about `size` bytes in all, at most 15 KiB each."""
    lines, i = [], 0
    while size > 0:
        part = min(size, 15 * 1024)
        lines.append(b"x-pad-%d: " % i + b"p" * part + b"\r\n")
        size, i = size - part, i + 1
    return b"".join(lines)


async def main(args: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="kvgw-slowloris-"))
    engine = SimProcess(workdir=workdir, decode_ms_base=1.0, max_model_len=512).start()
    clients = {
        "header_timeout_s": args.header_timeout_s,
        "body_timeout_s": args.body_timeout_s,
        "max_connections": args.max_connections,
        "max_connections_per_address": args.per_address,
    }
    config = {
        "engines": [{"name": "e0", "url": engine.url, "max_num_seqs": 64}],
        "models": [{"name": "tiny", "tokenizer": "hf:@tiny"}],
    }
    if not args.no_limits:
        config["clients"] = clients
    gateway = GatewayProcess(config, workdir, env=os.environ).start()
    print(f"gateway clients: {'(no limits)' if args.no_limits else clients}")
    try:
        head = b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\n" + padding(args.head_kib * 1024)
        await phase("slow headers", gateway, args.connections, head, b"x", args.hold_s)
        body_head = head + b"content-type: application/json\r\ncontent-length: 100000\r\n\r\n{"
        await phase("slow bodies", gateway, args.body_connections, body_head, b" ", args.hold_s)
    finally:
        gateway.stop()
        engine.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--body-connections", type=int, default=200)
    parser.add_argument("--header-timeout-s", type=float, default=10.0)
    parser.add_argument("--body-timeout-s", type=float, default=60.0)
    parser.add_argument("--max-connections", type=int, default=1000)
    parser.add_argument("--per-address", type=int, default=None)
    parser.add_argument("--hold-s", type=float, default=25.0)
    parser.add_argument("--head-kib", type=int, default=0)
    parser.add_argument("--no-limits", action="store_true")
    asyncio.run(main(parser.parse_args()))
