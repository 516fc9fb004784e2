"""How many TTL commands the Redis store's scripts run per admit + release pair.

    .venv/bin/python benchmarks/bench_ttl_calls.py [--pairs 2000]

One `RedisStore` (the tests' Redis: 127.0.0.1:6379 or a private server, tests/redis_server.py)
admits and releases `--pairs` leases of one tenant on one engine, one at a time and from 16
tasks at once; `INFO commandstats` before and after gives each command's calls per pair
(commands inside scripts counted). Run it in two trees to compare (`PYTHONPATH=<tree>`).
Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis.asyncio as aioredis

from tests.redis_server import redis_url
from tests.state.conftest import drop_keys, new_prefix, redis_store
from tests.state.test_conformance import ask, spec

COMMANDS = ("pttl", "pexpire", "exists", "set", "fcall", "evalsha")


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=2000)
    args = p.parse_args()
    prefix = new_prefix()
    store = redis_store(prefix, "bench")
    client = aioredis.from_url(redis_url())

    async def calls() -> dict[str, int]:
        stats = await client.info("commandstats")
        return {c: int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in COMMANDS}

    async def pairs(n: int) -> None:
        for _ in range(n):
            lease = await store.try_admit(ask(spec("a", blocks=4000, seqs=100), blocks=3))
            await store.release(lease)

    try:
        for concurrency in (1, 16):
            before = await calls()
            await asyncio.gather(*(pairs(args.pairs // concurrency) for _ in range(concurrency)))
            after = await calls()
            done = args.pairs // concurrency * concurrency
            per = {c: round((after[c] - before[c]) / done, 2) for c in COMMANDS}
            print(f"{concurrency:2d} at once, {done} pairs: per pair {per}", flush=True)
    finally:
        await store.close()
        await client.aclose()
        await drop_keys(prefix)


if __name__ == "__main__":
    asyncio.run(main())
