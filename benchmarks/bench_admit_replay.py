"""The Redis admit script of two or more source trees, compared call by call on one state.

    .venv/bin/python benchmarks/bench_admit_replay.py --trees /tmp/base,/work/main \
        [--shape 100x10000x1000] [--form grouped] [--calls 400] [--rounds 3]

`bench_admission_scale.py --trees` runs each tree in a child of its own for seconds at a
time; on a VM whose speed drifts by tens of percent within a minute, its rounds differ
more than the trees do. Here the trees take turns on every decision instead:

1. A private `redis-server` (nothing on disk) gets the state of one engines x tenants x
   waiting shape, set up by this tree's `RedisStore` exactly as `bench_admission_scale.py`
   sets it up (`redis_scenario`).
2. `--calls` decisions (asks from tenants spread over all of them) are made through the
   store and every script call each one sends is kept as sent: the admit, and the release
   when it was admitted.
3. Each tree's scripts (its `gateway/state/lua`) are loaded into the same server as a
   function library of their own, and every decision's calls are sent again to each
   library in turn, the order alternating from one decision to the next, `--rounds` times.
   The server time of each call is read from `INFO commandstats` (FCALL's µs) before and
   after it.

The trees' replies must be the same (the Redis time in them aside), else the run stops: a
comparison of scripts that decide differently would mean nothing. An admitted decision is
released again, so the state stays as set up; a refused one changes nothing but the
group's last-use stamp. The trees must take the same keys and arguments as this tree's
store sends (a change inside the scripts, not of their interface). Prints figures (p50,
p90, p99, mean per tree; the admits that carried Redis's Lua GC step, every 50th script
call, apart as in `bench_admission_scale.py`); asserts nothing but the replies' agreement.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import hiredis

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_admission_scale import (
    GC_PERIOD,
    bench_store,
    gc_phase,
    percentile,
    redis_scenario,
    script_stats,
)

from gateway.harness import RedisServer
from gateway.state import redis as redis_store
from gateway.state import scripts

_ADMIT = b"_admit\r\n"  # the admit script's function name ends so in the packed call

# A number in a reply that is Redis's clock (a lease's `now`, an entry's time to expiry).
_CLOCK = re.compile(rb"\$\d+\r\n(1\d{9}\.\d+|\d+\.\d{6,})\r\n")


def library_text(tree: Path, name: str) -> str:
    """The function library of `tree`'s scripts, named `name`."""
    lua = tree / "gateway" / "state" / "lua"
    return redis_store.library_source(name, lambda file: (lua / f"{file}.lua").read_text())


def renamed(packed: bytes, library: str) -> bytes:
    """An FCALL as packed (`*n $len FCALL $len <library>_<script> ...`) calling the same
    script of `library`."""
    head = packed.split(b"\r\n", 5)
    function = head[4]
    new = library.encode() + function[function.rindex(b"_") :]
    return b"\r\n".join([*head[:3], b"$%d" % len(new), new, head[5]])


async def capture(
    url: str, shape: tuple[int, int, int], form: str, calls: int
) -> list[list[bytes]]:
    """The state set up, then `calls` decisions made: each one's script calls as sent."""
    import redis.asyncio as aioredis

    from gateway.state.base import Lease

    window, prefix = 600.0, "replay"
    store = bench_store(url, prefix, window)
    client = aioredis.from_url(url)
    kept: list[bytes] = []
    original = scripts.Lane.call

    async def keeping(lane: Any, packed: list[bytes]) -> Any:
        kept.append(b"".join(packed))
        return await original(lane, packed)

    try:
        ask, policies = await redis_scenario(store, client, prefix, shape, window, form)
        for i in range(3):  # the scripts count the records written by the set-up once
            got = await store.try_admit(ask(f"warm-{i}", policies[i % len(policies)]))
            if isinstance(got, Lease):
                await store.release(got)
        decisions: list[list[bytes]] = []
        scripts.Lane.call = keeping  # type: ignore[method-assign]
        for i in range(calls):
            kept.clear()
            policy = policies[(i * 7919) % len(policies)]  # spread over the tenants
            got = await store.try_admit(ask(f"replay-{i}", policy))
            if isinstance(got, Lease):
                await store.release(got)
            decisions.append([p for p in kept if p.startswith(b"*") and b"FCALL" in p[:32]])
        return decisions
    finally:
        scripts.Lane.call = original  # type: ignore[method-assign]
        await store.close()
        await client.aclose()


async def replay(
    url: str, trees: list[Path], decisions: list[list[bytes]], rounds: int
) -> dict[str, Any]:
    import redis.asyncio as aioredis

    client = aioredis.from_url(url)
    kwargs = client.connection_pool.connection_kwargs
    reader, writer = await asyncio.open_connection(kwargs["host"], kwargs["port"])
    names = []
    for tree in trees:
        name = "replay_" + hashlib.sha1(str(tree).encode()).hexdigest()[:8]
        await client.execute_command("FUNCTION", "LOAD", "REPLACE", library_text(tree, name))
        names.append(name)
    calls = [[[renamed(c, name) for c in d] for d in decisions] for name in names]

    async def timed(packed: bytes) -> tuple[float, bytes, int]:
        """The call's server time (µs), its reply as sent, and the script calls so far."""
        calls, usec = await script_stats(client)
        writer.write(packed)
        await writer.drain()
        parser, reply = hiredis.Reader(), b""
        while True:  # the whole reply, however it arrives
            chunk = await reader.read(1 << 16)
            if not chunk:
                raise ConnectionError("redis-server closed the connection")
            reply += chunk
            parser.feed(chunk)
            if parser.gets() is not False:
                break
        calls2, usec2 = await script_stats(client)
        assert calls2 - calls == 1, (calls, calls2)  # this call's script, nothing else
        return float(usec2 - usec), reply, calls2

    admit: list[list[float]] = [[] for _ in trees]
    phases: list[list[int]] = [[] for _ in trees]
    release: list[list[float]] = [[] for _ in trees]
    try:
        for r in range(rounds):
            for i in range(len(decisions)):
                order = range(len(trees)) if (i + r) % 2 == 0 else reversed(range(len(trees)))
                replies = {}
                for k in order:
                    for packed in calls[k][i]:
                        us, reply, count = await timed(packed)
                        if _ADMIT in packed[:128]:
                            admit[k].append(us)
                            phases[k].append(count % GC_PERIOD)
                            replies[k] = _CLOCK.sub(b"", reply)
                        else:
                            release[k].append(us)
                if len(set(replies.values())) > 1:
                    raise SystemExit(f"decision {i}: the trees' replies differ: {replies}")
    finally:
        writer.close()
        await client.aclose()

    def figures(v: list[float]) -> dict[str, float]:
        return {
            "p50": statistics.median(v),
            "p90": percentile(v, 0.9),
            "p99": percentile(v, 0.99),
            "mean": round(statistics.mean(v), 1),
        }

    return {
        str(tree): {"admit": figures(admit[k]), **gc_phase(admit[k], phases[k])}
        | ({"release": figures(release[k])} if release[k] else {})
        for k, tree in enumerate(trees)
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_admit_replay.py", description=__doc__.split("\n")[0])
    p.add_argument("--trees", required=True, help="comma-separated source trees")
    p.add_argument("--shape", default="100x10000x1000", help="engines x tenants x waiting")
    p.add_argument("--form", default="grouped", help="candidates or grouped asks")
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    trees = [Path(t) for t in args.trees.split(",") if t]
    shape = tuple(int(x) for x in args.shape.split("x"))
    assert len(shape) == 3, args.shape
    server = RedisServer().start()
    try:
        decisions = asyncio.run(capture(server.url, shape, args.form, args.calls))  # type: ignore[arg-type]
        outcomes: dict[str, int] = {}
        for d in decisions:
            kind = "admitted" if any(b"_release\r\n" in c[:128] for c in d) else "refused"
            outcomes[kind] = outcomes.get(kind, 0) + 1
        print(f"shape {args.shape} {args.form}: {args.calls} decisions, {outcomes}")
        got = asyncio.run(replay(server.url, trees, decisions, args.rounds))
    finally:
        server.stop()
    for tree, figures in got.items():
        print(tree, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
