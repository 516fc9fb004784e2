"""What the gateway's listener costs per request: uvicorn's stock protocols against the
gateway's (`gateway.http.listener`: header/body timers and the connection ledger).

    .venv/bin/python benchmarks/bench_listener.py [--requests 20000] [--connections 16]
                                                 [--rounds 3]

For each protocol — `httptools` (uvicorn's default), `guarded` (the gateway's subclass of
it), `h11` (uvicorn's pure-Python one) — a child process serves a trivial ASGI app (reads
the body, answers 2 bytes) on 127.0.0.1, and this process sends small POSTs over
`--connections` keep-alive connections, then the same over a new connection per request.
The figure is the server's CPU time per request (from /proc), which hardly depends on what
else the machine runs; rounds alternate the protocols' order. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

from gateway.harness import die_with_parent, free_port

TICKS = os.sysconf("SC_CLK_TCK")
PROTOCOLS = ["httptools", "guarded", "h11"]
REQUEST = (
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b'content-length: 30\r\n\r\n{"model": "tiny", "prompt": 1}'
)

SERVER = """
import sys, uvicorn
from gateway.config import ClientsConfig
from gateway.http.listener import protocol_for

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})

kind, port = sys.argv[1], int(sys.argv[2])
http = protocol_for(ClientsConfig()) if kind == "guarded" else kind
uvicorn.run(app, host="127.0.0.1", port=port, http=http, log_level="error",
            access_log=False, lifespan="off")
"""


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def one_answer(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    await reader.readexactly(2)


async def keep_alive(port: int, n: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(n):
        writer.write(REQUEST)
        await one_answer(reader)
    writer.close()


async def fresh(port: int, n: int) -> None:
    for _ in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(REQUEST)
        await one_answer(reader)
        writer.close()


async def measure(pid: int, port: int, requests: int, connections: int, new_each: bool) -> float:
    per = requests // connections
    work = fresh if new_each else keep_alive
    await asyncio.gather(*(work(port, 50) for _ in range(connections)))  # warm-up
    before = cpu_s(pid)
    await asyncio.gather(*(work(port, per) for _ in range(connections)))
    return 1e6 * (cpu_s(pid) - before) / (per * connections)  # µs per request


async def main(args: argparse.Namespace) -> None:
    results: dict[tuple[str, bool], list[float]] = {}
    for round_ in range(args.rounds):
        order = PROTOCOLS if round_ % 2 == 0 else PROTOCOLS[::-1]
        for kind in order:
            port = free_port()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", SERVER, kind, str(port), preexec_fn=die_with_parent
            )
            try:
                deadline = time.monotonic() + 20
                while True:
                    try:
                        _, w = await asyncio.open_connection("127.0.0.1", port)
                        w.close()
                        break
                    except OSError:
                        assert time.monotonic() < deadline, f"{kind} did not start"
                        await asyncio.sleep(0.05)
                for new_each in (False, True):
                    n = args.requests if not new_each else args.requests // 4
                    us = await measure(proc.pid, port, n, args.connections, new_each)
                    results.setdefault((kind, new_each), []).append(us)
            finally:
                proc.terminate()
                await asyncio.wait_for(proc.wait(), 10)
    print(f"server CPU per request, µs (median of {args.rounds} rounds; all rounds)")
    print(f"{'protocol':<10} {'keep-alive':>24} {'new connection each':>30}")
    for kind in PROTOCOLS:
        cells = []
        for new_each in (False, True):
            xs = results[(kind, new_each)]
            cells.append(f"{statistics.median(xs):6.1f} ({', '.join(f'{x:.0f}' for x in xs)})")
        print(f"{kind:<10} {cells[0]:>24} {cells[1]:>30}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
