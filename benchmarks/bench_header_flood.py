"""What oversized request headers cost the gateway: memory, CPU, and what each client got.

    .venv/bin/python benchmarks/bench_header_flood.py [--connections 64] [--header-mib 64]
                                                     [--hold-s 5] [--rounds 1] [--body]

Starts, on 127.0.0.1, a simulated engine and `kv-gateway serve` (the `clients:` limits at
their defaults), then opens `--connections` connections at once, each sending
`GET /v1/models` with an `Authorization: Bearer xxx…` header of `--header-mib` MiB, never
ended, in 64 KiB writes as fast as the gateway reads them, until the gateway answers or
closes; each then holds its connection open for `--hold-s` (what it sent stays the gateway's
to hold, if it kept it). Prints, per round: each connection's outcome (431, another status,
closed or reset with no answer) and how much it could send before it, the gateway's resident
memory (VmRSS, /proc) before, at the peak (sampled every 5 ms) and after, against
`connections × max_head_bytes + 10 MiB`, and the gateway's CPU time. Asserts nothing.

`--body`: the same flood as request bodies from clients without a valid key — the gateway
has a tenant, and each connection sends `POST /v1/completions` with a wrong key,
`content-length` of `--header-mib` MiB (keep it within `upstream.max_body_bytes`, 16 MiB)
and that body.

For a gateway without these limits, put an older checkout first on PYTHONPATH (`git archive
<commit> | tar -x -C DIR`); that gateway reads every header whole, so keep `--connections ×
--header-mib` well under the machine's memory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench_slowloris import cpu_s, rss_kib  # the same /proc readings (run from benchmarks/)

from gateway.config import ClientsConfig
from gateway.harness import GatewayProcess, SimProcess

PIECE = b"x" * 65536
MIB = 1024 * 1024


class Flooder:
    """One connection sending an endless header: what it could send, and what it got."""

    def __init__(self) -> None:
        self.sent = 0
        self.outcome = "open"  # "431", another status, "closed", "reset" or "failed"
        self.after_s: float | None = None

    async def run(
        self, port: int, head: bytes, size: int, hold_s: float, go: asyncio.Event, timeout_s: float
    ) -> None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            self.outcome = "failed"
            return
        await go.wait()
        started = time.monotonic()
        reading = asyncio.ensure_future(reader.read(4096))
        try:
            writer.write(head)
            with contextlib.suppress(OSError):  # the gateway closed: its answer is read below
                while self.sent < size and not reading.done():
                    if time.monotonic() - started > timeout_s:
                        break
                    writer.write(PIECE)
                    self.sent += len(PIECE)
                    await writer.drain()
            left_s = timeout_s - (time.monotonic() - started)
            await asyncio.wait({reading}, timeout=max(0.0, left_s))
            if not reading.done():
                return  # "open": no answer within timeout_s
            self.after_s = time.monotonic() - started
            try:
                answer = reading.result()
            except OSError:
                self.outcome = "reset"
                return
            self.outcome = answer[9:12].decode() if answer.startswith(b"HTTP/1.1 ") else "closed"
            await asyncio.sleep(hold_s)
        finally:
            reading.cancel()
            writer.close()


async def sample_peak(pid: int, stop: asyncio.Event) -> int:
    peak = 0
    while not stop.is_set():
        peak = max(peak, rss_kib(pid))
        await asyncio.sleep(0.005)
    return max(peak, rss_kib(pid))


async def one_round(gateway: GatewayProcess, args: argparse.Namespace, limit: int) -> None:
    pid = gateway.pid
    assert pid is not None
    port = gateway.port
    rss_before, cpu_before = rss_kib(pid), cpu_s(pid)
    flooders = [Flooder() for _ in range(args.connections)]
    go, stop = asyncio.Event(), asyncio.Event()
    size = int(args.header_mib * MIB)
    if args.body:
        head = b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer wrong\r\n"
        head += b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % size
    else:
        head = b"GET /v1/models HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer "
    tasks = [
        asyncio.create_task(f.run(port, head, size, args.hold_s, go, args.timeout_s))
        for f in flooders
    ]
    await asyncio.sleep(0.2)  # every connection open, then all send at once
    peak_task = asyncio.create_task(sample_peak(pid, stop))
    started = time.monotonic()
    go.set()
    await asyncio.gather(*tasks)
    wall = time.monotonic() - started
    stop.set()
    peak = await peak_task
    await asyncio.sleep(1.0)
    rss_after, cpu = rss_kib(pid), cpu_s(pid) - cpu_before
    outcomes = Counter(f.outcome for f in flooders)
    sent = sorted(f.sent for f in flooders)
    ends = sorted(f.after_s for f in flooders if f.after_s is not None)
    bound_kib = args.connections * limit // 1024 + 10 * 1024
    print(f"  outcomes: {dict(sorted(outcomes.items()))}")
    print(
        f"  sent before the answer: min {sent[0] / 1024:.0f} KiB, median"
        f" {sent[len(sent) // 2] / 1024:.0f} KiB, max {sent[-1] / 1024:.0f} KiB"
        f" (of {size / MIB:g} MiB each)"
    )
    if ends:
        print(f"  answered after: min {ends[0]:.2f} s, max {ends[-1]:.2f} s")
    print(
        f"  gateway RSS: {rss_before / 1024:.1f} MiB before, {peak / 1024:.1f} MiB peak"
        f" (+{(peak - rss_before) / 1024:.1f} MiB; bound {args.connections} x"
        f" {limit // 1024} KiB + 10 MiB = {bound_kib / 1024:.1f} MiB), {rss_after / 1024:.1f}"
        f" MiB 1 s after"
    )
    print(f"  gateway CPU: {cpu:.2f} s over {wall:.1f} s")


async def main(args: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="kvgw-header-flood-"))
    engine = SimProcess(workdir=workdir, decode_ms_base=1.0, max_model_len=512).start()
    config = {
        "engines": [{"name": "e0", "url": engine.url, "max_num_seqs": 64}],
        "models": [{"name": "tiny", "tokenizer": "hf:@tiny"}],
    }
    if args.body:  # a key is needed, and the flood has none
        config["tenants"] = [{"name": "t", "api_keys": [hashlib.sha256(b"key").hexdigest()]}]
    # An older gateway (no such limit) is shown against the default all the same.
    limit = getattr(ClientsConfig(), "max_head_bytes", 64 * 1024)
    gateway = GatewayProcess(config, workdir, env=os.environ).start()
    print(
        f"gateway at {gateway.url}, clients: defaults; {args.connections} connections x"
        f" {args.header_mib:g} MiB {'body' if args.body else 'header'}, held {args.hold_s:g} s"
        " after the answer"
    )
    try:
        for i in range(args.rounds):
            print(f"round {i + 1}:")
            await one_round(gateway, args, limit)
    finally:
        with contextlib.suppress(Exception):
            gateway.stop()
        engine.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--header-mib", type=float, default=64.0)
    parser.add_argument("--hold-s", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--body", action="store_true")
    asyncio.run(main(parser.parse_args()))
