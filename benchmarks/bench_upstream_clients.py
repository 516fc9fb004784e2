"""CPU per request of the two HTTP clients the gateway could use upstream, in one run.

    python benchmarks/bench_upstream_clients.py [--requests 2000] [--concurrency 1,32] [--rounds 2]

Starts a zero-cost simulated engine (`python -m gateway.sim`, all step times 0) in a child
process on 127.0.0.1, then, in this process, sends the same small completion (7-token
prompt, 8 output tokens, `ignore_eos`) through a pooled `httpx.AsyncClient` and a pooled
`aiohttp.ClientSession`, configured as the gateway configures them, reading each body to its
end as the gateway relays it. Prints this process's CPU time per request and its request
rate for each client and concurrency; the two clients alternate, so the machine's load falls
on both alike. This is the check that chose aiohttp for the gateway's data plane
(docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import aiohttp
import httpx

from gateway.harness import SimProcess

BODY = json.dumps(
    {"model": "tiny", "prompt": list(range(100, 107)), "max_tokens": 8, "ignore_eos": True}
).encode()
HEADERS = {"content-type": "application/json", "x-request-id": "bench"}


async def measure(name: str, one: Callable[[], Awaitable[None]], n: int, c: int) -> None:
    for _ in range(200):  # warm-up: connections opened, code paths hot
        await one()
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one()

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(c)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    print(f"  {name:8} c={c:<4} CPU per request {cpu / n * 1000:6.3f} ms   {n / wall:7.0f} req/s")


async def with_httpx(url: str, n: int, c: int) -> None:
    limits = httpx.Limits(max_connections=1000, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:

        async def one() -> None:
            request = client.build_request("POST", url, content=BODY, headers=HEADERS)
            response = await client.send(request, stream=True)
            async for _ in response.aiter_raw():
                pass
            await response.aclose()

        await measure("httpx", one, n, c)


async def with_aiohttp(url: str, n: int, c: int) -> None:
    connector = aiohttp.TCPConnector(limit=1000, keepalive_timeout=2.0)
    async with aiohttp.ClientSession(
        connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
    ) as session:

        async def one() -> None:
            async with session.post(url, data=BODY, headers=HEADERS) as response:
                async for _ in response.content.iter_any():
                    pass

        await measure("aiohttp", one, n, c)


async def run(args: argparse.Namespace, url: str) -> None:
    for c in args.concurrency:
        for r in range(args.rounds):
            print(f"round {r + 1}")
            await with_httpx(url, args.requests, c)
            await with_aiohttp(url, args.requests, c)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32]
    )
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    engine = SimProcess(
        num_gpu_blocks=65536,
        max_num_seqs=1024,
        decode_ms_base=0,
        decode_ms_per_seq=0,
        prefill_ms_per_token=0,
    ).start()
    try:
        asyncio.run(run(args, f"{engine.url}/v1/completions"))
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
