"""Admission at scale (issue 14): the stores' `try_admit` against engines, tenants and
waiting requests, and how many decisions one release causes.

    nice -n 0 .venv/bin/python benchmarks/bench_admission_scale.py [--trees A,B] [--rounds 2]
                                                [--seconds 3] [--stores memory,redis]
                                                [--pairs 16] [--asks candidates,grouped]

Decision cost, for each engines x tenants x waiting shape of the issue's table: a store with
that many engines (8 blocks each way plus room to spare), each tenant admitted one 8-block
lease and every second one released again (all active: holding, or seen within the
window), `waiting` entries in the line (from the tenants in turn, for every engine); then
asks of 8 blocks over all engines from the tenants in turn (an admitted one is released
again, untimed), p50 / p99 of each `try_admit` call. The clock is injected and moves 1 ms
per decision, so nobody ages out of the window. `--asks`: in-process, the asks as one
candidate per engine (every engine scored), or grouped (`AdmissionAsk.group`: the store
keeps the engines ordered; a tree without it reports "unsupported"). On Redis too: a
grouped ask is decided from the engines Redis keeps ordered (admit.lua `ordered`); a tree
from before that expands it in the client (the same as candidates).

Decisions per release: `waiters` requests wait in `gateway.scheduler.Scheduler.admit` (one
full engine, each wants all of it); one lease is released and the `try_admit` calls until
the first waiter holds its lease plus 50 ms (less than the scheduler's 0.25 s poll) are
counted; then the calls in one second at rest (polls). A count ending in `t` (`--waiters
100t`): each waiter its own tenant (headroom on). In-process, and with `--stores`
with `redis` also on a `RedisStore` (the private server), its waiters in one process.

Redis (`--stores` with `redis`): the same shapes on a `RedisStore` against a private
`redis-server` this script starts (nothing on disk): the server's time per admit script and
per release script (the FCALL's or EVALSHA's `usec` in `INFO commandstats`, read before and
after each call, untimed; SLOWLOG would log every command the script runs too, and slow it
down), and the wall time of each `try_admit` call, p50 / p99. The clock is Redis's, so the active
window is 600 s (nobody ages out while the set-up runs). Set-up, the same for any version
of the scripts: the tenants admitted (64 calls at a time) and queued with headroom off, then
their headroom records (`act`, as common.lua documents it) written in one pipeline; three
untimed decisions first (the new scripts count those records once). Redis runs a step of
Lua's garbage collector in every 50th script call (`GC_PERIOD`), so about 2 % of the calls
carry it, and the p99 falls among them: the admits of that place in the count are reported
apart (`gc_step_calls_p50_us`), with the p50 / p99 of the others. Renewals
(`--renewals`): one replica holding that many leases renews them, three rounds; the renew
script calls per round and each call's server time.

Client cost (`--pairs C` with `redis` in `--stores`): admit + release pairs from C tasks at
once on one engine (one lease each, 4 tenants), three rounds of 4,000 pairs after 200
untimed: this process's CPU per pair (the store's client side: arguments, packing, the
connection, the replies) and redis-server's (`INFO cpu`), and pairs per second.

`--retry-groups K` (grouped asks): K more groups named besides the one asked on, each of
the engines but one, as the sets of retries that excluded an engine are: each change of an
engine's load moves it in every group it belongs to.

`--trees A,B`: run every measurement in a child process per source tree (`KVGW_TREE=A`,
`B`: its `gateway` package), alternating tree by tree and round by round, so the
machine's drift falls on both; the figures name the tree. Without it, the tree this
script is imported from. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SHAPES = ((1, 1, 0), (100, 1, 0), (1, 100, 1000), (100, 10000, 0), (100, 10000, 1000))
WAITERS = (10, 100, 1000)
REDIS_URL = "KVGW_BENCH_REDIS_URL"  # the private redis-server, for the children
RETRY_GROUPS = "KVGW_BENCH_RETRY_GROUPS"  # `--retry-groups`, for the children


async def _retry_groups(store: Any, names: frozenset[str]) -> None:
    """`--retry-groups K`: K more groups named, each of the engines but one (the sets of
    retries that excluded an engine), moved at every change of their engines' load."""
    ordered = sorted(names)
    for k in range(min(len(ordered), int(os.environ.get(RETRY_GROUPS, "0")))):
        await store.set_group(f"retry-{k}", frozenset(ordered) - {ordered[k]}, 1.0)


GC_PERIOD = 50
"""Redis runs a step of Lua's garbage collector in every 50th script call, whatever the
script (`LUA_GC_CYCLE_PERIOD` in Redis's script_lua.c): that call's time includes it."""


def gc_phase(server_us: list[float], phases: list[int]) -> dict[str, Any]:
    """The calls that took Redis's Lua GC step apart from the others: the script calls
    whose number mod `GC_PERIOD` has the highest median (the step's place in the count
    is not known: a server counts every script call since it started; where admits
    alternate with releases, half the steps fall on releases); that median, and the
    p50 / p99 of the other calls."""
    by: dict[int, list[float]] = {}
    for us, phase in zip(server_us, phases, strict=True):
        by.setdefault(phase, []).append(us)
    if len(by) < 2 or min(len(v) for v in by.values()) < 10:  # too few calls to tell
        return {}
    step = max(by, key=lambda k: statistics.median(by[k]))
    rest = [us for us, phase in zip(server_us, phases, strict=True) if phase != step]
    return {
        "gc_step_calls_p50_us": round(statistics.median(by[step]), 1),
        "other_calls_p50_us": round(statistics.median(rest), 1),
        "other_calls_p99_us": round(percentile(rest, 0.99), 1),
    }


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q` quantile (0 < q <= 1) of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def _scenario(engines: int, tenants: int, waiting: int) -> tuple[Any, frozenset[str], list[Any]]:
    """The asks' candidates (an 8-block need on each of `engines` large enough for every
    lease and waiter), the engines' names, and one policy per tenant."""
    from gateway.core.routing import Candidate
    from gateway.core.types import EngineLoad, EngineSpec, EngineView, Footprint, TenantPolicy

    blocks = 8 * (2 * tenants + waiting) // engines + 200
    specs = [
        EngineSpec(f"e{i}", f"http://e{i}", frozenset({"m"}), blocks + 1, 16, 10**6, 10**6)
        for i in range(engines)
    ]
    need = Footprint(8, 1, 128)
    candidates = tuple(Candidate(EngineView(s, EngineLoad()), need) for s in specs)
    names = frozenset(s.name for s in specs)
    return candidates, names, [TenantPolicy(name=f"t{i}") for i in range(tenants)]


async def decisions(
    engines: int, tenants: int, waiting: int, seconds: float, form: str = "candidates"
) -> dict[str, Any]:
    from gateway.core.routing import Router
    from gateway.core.types import TenantPolicy
    from gateway.state.base import AdmissionAsk, Lease, QueueEntry
    from gateway.state.memory import InMemoryStore

    clock = Clock()
    store = InMemoryStore(Router(), random.Random(0), clock=clock)
    candidates, names, policies = _scenario(engines, tenants, waiting)
    grouped = form == "grouped"
    if grouped:
        if not hasattr(store, "set_group"):
            return {"shape": f"{engines}x{tenants}x{waiting}", "asks": form, "unsupported": True}
        await store.set_views([c.view for c in candidates])
        await store.set_group("all", names, 1.0)
        await _retry_groups(store, names)

    def ask(i: int, policy: TenantPolicy) -> AdmissionAsk:
        if grouped:
            return AdmissionAsk(f"ask-{i}", tenant=policy, group="all", need=candidates[0].need)
        return AdmissionAsk(f"ask-{i}", candidates, 1.0, policy)

    for i, policy in enumerate(policies):
        lease = await store.try_admit(ask(i, policy))
        assert isinstance(lease, Lease), lease
        if i % 2:
            await store.release(lease)
    store.headroom, headroom = 0.0, store.headroom  # quick set-up: nobody new to observe
    for i in range(waiting):
        entry = QueueEntry(f"wait-{i}", policies[i % tenants], names, 8, 10**6)
        assert await store.enqueue(entry, 10**6) == "queued"
    store.headroom = headroom
    times: list[float] = []
    outcomes: dict[str, int] = {}
    started = time.perf_counter()
    i = 0
    while (time.perf_counter() - started < seconds or len(times) < 20) and len(times) < 20000:
        clock.now += 0.001
        a = ask(10**7 + i, policies[i % tenants])
        t0 = time.perf_counter_ns()
        result = await store.try_admit(a)
        times.append((time.perf_counter_ns() - t0) / 1000)
        code = "admitted" if isinstance(result, Lease) else result.code
        outcomes[code] = outcomes.get(code, 0) + 1
        if isinstance(result, Lease):
            await store.release(result)
        i += 1
    return {
        "shape": f"{engines}x{tenants}x{waiting}",
        "asks": form,
        "calls": len(times),
        "p50_us": round(statistics.median(times), 1),
        "p99_us": round(percentile(times, 0.99), 1),
        "outcomes": outcomes,
    }


async def script_stats(client: Any) -> tuple[int, int]:
    """Script calls so far and the µs redis-server spent in them: FCALL (the store's function
    library) and EVALSHA (a Redis without functions, or an older tree) together."""
    stats = await client.info("commandstats")
    got = [stats.get(f"cmdstat_{c}", {}) for c in ("fcall", "evalsha")]
    return sum(int(g.get("calls", 0)) for g in got), sum(int(g.get("usec", 0)) for g in got)


def bench_store(url: str, prefix: str, window: float) -> Any:
    """A `RedisStore` for the Redis measurements: its keys under `prefix`, the active
    window `window` s, leases that outlast any run, a fixed tie-break seed."""
    from gateway.core.routing import DEFAULT_SCORERS
    from gateway.state.redis import RedisStore

    return RedisStore(
        url,
        DEFAULT_SCORERS,
        replica_id="bench",
        key_prefix=prefix,
        seed=0,
        lease_ttl_s=600.0,
        active_window_s=window,
        timeout_s=30.0,
    )


async def redis_scenario(
    store: Any, client: Any, prefix: str, shape: tuple[int, int, int], window: float, form: str
) -> tuple[Callable[[str, Any], Any], list[Any]]:
    """The state of an engines x tenants x waiting `shape` on a `RedisStore` (its keys under
    `prefix`, `client` on the same server): each tenant admitted one 8-block lease, every
    second one released again, `waiting` entries in the line, then the tenants' headroom
    records written as active within `window`. Returns how to ask (lease id, policy) in the
    `form` of ask (candidates or grouped) and the tenants' policies."""
    from gateway.state.base import AdmissionAsk, Lease, QueueEntry

    engines, tenants, waiting = shape
    candidates, names, policies = _scenario(engines, tenants, waiting)
    grouped = form == "grouped"
    if grouped:  # a tree before the Redis order expands grouped asks in the client
        await store.set_views([c.view for c in candidates])
        await store.set_group("all", names, 1.0)
        await _retry_groups(store, names)

    def ask(name: str, policy: Any) -> AdmissionAsk:
        if grouped:
            return AdmissionAsk(name, tenant=policy, group="all", need=candidates[0].need)
        return AdmissionAsk(name, candidates, 1.0, policy)

    store.headroom, headroom = 0.0, store.headroom  # set-up: records written below

    async def setup(i: int) -> None:
        lease = await store.try_admit(ask(f"a{i}", policies[i]))
        assert isinstance(lease, Lease), lease
        if i % 2:
            await store.release(lease)

    async def wait(i: int) -> None:
        entry = QueueEntry(f"w{i}", policies[i % tenants], names, 8, 10**5)
        assert await store.enqueue(entry, 10**6) == "queued"

    for start in range(0, tenants, 64):
        await asyncio.gather(*(setup(i) for i in range(start, min(tenants, start + 64))))
    for start in range(0, waiting, 64):
        await asyncio.gather(*(wait(i) for i in range(start, min(waiting, start + 64))))
    sec, usec = await client.time()
    now = repr(sec + usec / 1e6)
    pipe = client.pipeline(transaction=False)
    for i, policy in enumerate(policies):
        held = "0" if i % 2 else "8"
        record = {"w": "1", "s": now, "u": held, "us": now, "n": repr(window)}
        pipe.hset(f"{{{prefix}}}:act", policy.name, json.dumps(record))
    await pipe.execute()
    store.headroom = headroom
    return ask, policies


async def redis_decisions(
    engines: int, tenants: int, waiting: int, seconds: float, url: str, form: str = "candidates"
) -> dict[str, Any]:
    import redis.asyncio as aioredis

    from gateway.state.base import Lease

    window = 600.0
    prefix = f"bench-{os.getpid()}"
    store = bench_store(url, prefix, window)
    client = aioredis.from_url(url)
    try:
        ask, policies = await redis_scenario(
            store, client, prefix, (engines, tenants, waiting), window, form
        )

        async def server_us(call: Any, check: bool) -> tuple[Any, float, float, int]:
            """The call's result, its wall time, its script's server time (µs) and the
            number of script calls so far."""
            calls, usec = await script_stats(client)
            t0 = time.perf_counter_ns()
            result = await call
            wall = (time.perf_counter_ns() - t0) / 1000
            calls2, usec2 = await script_stats(client)
            # This call's script only (a first call may load its script: NOSCRIPT, again).
            assert calls2 - calls == 1 or not check, (calls, calls2)
            return result, wall, float(usec2 - usec), calls2

        times: list[float] = []
        admit_us: list[float] = []
        phases: list[int] = []  # each admit's script call number, mod GC_PERIOD
        release_us: list[float] = []
        outcomes: dict[str, int] = {}
        i = 0
        started = time.perf_counter()
        while (time.perf_counter() - started < seconds or len(times) < 20) and len(times) < 3000:
            if i == 3:  # three untimed first
                times.clear()
                admit_us.clear()
                release_us.clear()
                outcomes.clear()
                phases.clear()
                started = time.perf_counter()
            a = ask(f"ask-{10**7 + i}", policies[i % tenants])
            result, wall, server, calls = await server_us(store.try_admit(a), i >= 3)
            times.append(wall)
            admit_us.append(server)
            phases.append(calls % GC_PERIOD)
            code = "admitted" if isinstance(result, Lease) else result.code
            outcomes[code] = outcomes.get(code, 0) + 1
            if isinstance(result, Lease):
                release_us.append((await server_us(store.release(result), i >= 3))[2])
            i += 1
        got: dict[str, Any] = {
            "shape": f"{engines}x{tenants}x{waiting}",
            "store": "redis",
            "asks": form,
            "calls": len(times),
            "server_p50_us": round(statistics.median(admit_us), 1),
            "server_p99_us": round(percentile(admit_us, 0.99), 1),
            "wall_p50_us": round(statistics.median(times), 1),
            "wall_p99_us": round(percentile(times, 0.99), 1),
            "outcomes": outcomes,
        }
        got.update(gc_phase(admit_us, phases))
        if release_us:
            got["release_server_p50_us"] = round(statistics.median(release_us), 1)
            got["release_server_p99_us"] = round(percentile(release_us, 0.99), 1)
        return got
    finally:
        await store.close()
        await client.flushdb()  # the script's own server
        await client.aclose()


async def redis_pairs(concurrency: int, url: str) -> dict[str, Any]:
    """Admit + release pairs, `concurrency` at a time: client and server CPU per pair."""
    import redis.asyncio as aioredis

    from gateway.core.routing import DEFAULT_SCORERS
    from gateway.state.base import AdmissionAsk, Lease
    from gateway.state.redis import RedisStore

    store = RedisStore(
        url, DEFAULT_SCORERS, replica_id="bench", key_prefix=f"pairs-{os.getpid()}", seed=0
    )
    client = aioredis.from_url(url)
    candidates, _, policies = _scenario(1, 4, concurrency)
    pairs, rounds = 4000 // concurrency * concurrency, []

    async def pair(i: int) -> None:
        lease = await store.try_admit(AdmissionAsk(f"p{i}", candidates, 1.0, policies[i % 4]))
        assert isinstance(lease, Lease), lease
        await store.release(lease)

    async def worker(w: int) -> None:
        for k in range(pairs // concurrency):
            await pair(10**6 + w * pairs + k)

    async def server_cpu() -> float:
        info = await client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    try:
        for i in range(200):
            await pair(i)
        for _ in range(3):
            s0, c0, t0 = await server_cpu(), time.process_time(), time.perf_counter()
            await asyncio.gather(*(worker(w) for w in range(concurrency)))
            t1, c1, s1 = time.perf_counter(), time.process_time(), await server_cpu()
            rounds.append(
                {
                    "client_us_per_pair": round(1e6 * (c1 - c0) / pairs, 1),
                    "server_us_per_pair": round(1e6 * (s1 - s0) / pairs, 1),
                    "pairs_per_s": round(pairs / (t1 - t0)),
                }
            )
        return {"concurrency": concurrency, "pairs": pairs, "rounds": rounds}
    finally:
        await store.close()
        await client.flushdb()
        await client.aclose()


async def redis_renewal(leases: int, url: str) -> dict[str, Any]:
    """One renewal round of `leases` leases held by one replica: the renew scripts it runs
    and each one's server time (INFO commandstats around each script call)."""
    import redis.asyncio as aioredis

    from gateway.core.routing import DEFAULT_SCORERS, Candidate
    from gateway.core.types import EngineLoad, EngineSpec, EngineView, Footprint
    from gateway.state.base import AdmissionAsk, Lease
    from gateway.state.redis import RedisStore

    prefix = f"bench-renew-{os.getpid()}"
    store = RedisStore(url, DEFAULT_SCORERS, replica_id="bench", key_prefix=prefix, seed=0)
    client = aioredis.from_url(url)
    spec = EngineSpec("e", "http://e", frozenset({"m"}), 10**6, 16, 10**6, 10**8)
    candidates = (Candidate(EngineView(spec, EngineLoad()), Footprint(2, 1, 32)),)
    try:
        for first in range(0, leases, 64):
            await asyncio.gather(
                *(
                    store.try_admit(AdmissionAsk(f"l{i}", candidates, 1.0))
                    for i in range(first, min(leases, first + 64))
                )
            )
        per_call: list[float] = []
        write = store._write_leases

        async def timed(records: Any, entries: Any = ()) -> Any:
            before = (await script_stats(client))[1]
            got = await write(records, entries)
            after = (await script_stats(client))[1]
            per_call.append(float(after - before))
            return got

        store._write_leases = timed  # type: ignore[method-assign]
        rounds = []
        for _ in range(3):
            per_call.clear()
            await store._renew(dict(store._held))
            rounds.append(
                {"calls": len(per_call), "max_us": max(per_call), "sum_us": sum(per_call)}
            )
        by_id = (Lease(id=f"l{i}", engine="", blocks=0, seqs=0) for i in range(leases))
        await asyncio.gather(*(store.release(lease) for lease in by_id))
        return {"leases": leases, "rounds": rounds}
    finally:
        await store.close()
        await client.flushdb()
        await client.aclose()


async def per_release(
    waiters: int, url: str | None = None, tenants: bool = False
) -> dict[str, Any]:
    from gateway.core.retry import ReleaseRate
    from gateway.core.routing import DEFAULT_SCORERS, Router
    from gateway.core.types import DEFAULT_TENANT, EngineSpec, Footprint, TenantPolicy
    from gateway.engines.pool import EnginePool
    from gateway.scheduler import Ask, Scheduler
    from gateway.state.base import AdmissionAsk, Lease, Refusal
    from gateway.state.memory import InMemoryStore
    from gateway.state.redis import RedisStore

    base: Any = InMemoryStore if url is None else RedisStore

    class Counting(base):  # type: ignore[misc, valid-type]
        calls = 0

        async def try_admit(self, ask: AdmissionAsk) -> Lease | Refusal:
            self.calls += 1
            return await super().try_admit(ask)  # type: ignore[no-any-return]

    spec = EngineSpec("e", "http://e", frozenset({"m"}), 101, 16, 10**6, 10**6)  # 100 blocks
    if url is None:
        store = Counting(Router(), random.Random(0))
    else:
        prefix = f"bench-release-{os.getpid()}"
        store = Counting(url, DEFAULT_SCORERS, replica_id="bench", key_prefix=prefix, seed=0)
    sched = Scheduler(
        store=store,
        pool=EnginePool([spec]),
        kv_ceiling=1.0,
        max_length=10**6,
        max_wait_s=60.0,
        retry_fallback_s=1.0,
        rate=ReleaseRate(10.0),
    )
    whole = Footprint(100, 1, 1600)
    holder = await sched.admit(Ask(id="holder", needs={"e": whole}))
    tasks = [
        asyncio.ensure_future(
            sched.admit(
                Ask(
                    id=f"w{i}",
                    needs={"e": whole},
                    tenant=TenantPolicy(f"t{i}") if tenants else DEFAULT_TENANT,
                )
            )
        )
        for i in range(waiters)
    ]
    while len(sched.waiting) < waiters:  # noqa: ASYNC110 (the scheduler has no event for it)
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)  # past one poll: the waiters are spread over it
    store.calls = 0
    await sched.release(holder)
    await asyncio.wait(tasks, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
    await asyncio.sleep(0.05)
    after_release = store.calls
    store.calls = 0
    await asyncio.sleep(1.0)
    at_rest = store.calls
    for t in tasks:
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for r in results:
        if isinstance(r, Lease):
            await sched.release(r)
    await store.close()
    return {
        "waiters": waiters,
        "tenants": waiters if tenants else 1,
        "decisions_after_one_release": after_release,
        "admitted_by_it": 1,
        "decisions_per_s_at_rest": at_rest,
    }


def measure(kind: str, arg: str, seconds: float) -> dict[str, Any]:
    import gateway

    if kind == "decisions":
        shape, _, form = arg.partition(":")
        e, t, w = (int(x) for x in shape.split("x"))
        got = asyncio.run(decisions(e, t, w, seconds, form or "candidates"))
    elif kind == "redis":
        shape, _, form = arg.partition(":")
        e, t, w = (int(x) for x in shape.split("x"))
        url = os.environ[REDIS_URL]
        got = asyncio.run(redis_decisions(e, t, w, seconds, url, form or "candidates"))
    elif kind == "redis-pairs":
        got = asyncio.run(redis_pairs(int(arg), os.environ[REDIS_URL]))
    elif kind == "redis-renew":
        got = asyncio.run(redis_renewal(int(arg), os.environ[REDIS_URL]))
    elif kind == "redis-release":
        got = asyncio.run(per_release(int(arg.rstrip("t")), os.environ[REDIS_URL], arg[-1] == "t"))
    else:
        got = asyncio.run(per_release(int(arg.rstrip("t")), None, arg[-1] == "t"))
    return got | {"gateway": str(Path(gateway.__file__).parent)}


def child(tree: str, kind: str, arg: str, seconds: float) -> dict[str, Any]:
    env = dict(os.environ, KVGW_TREE=tree)
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, arg, "--seconds", str(seconds)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result: dict[str, Any] = json.loads(out.splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_admission_scale.py", description=__doc__.split("\n")[0])
    p.add_argument("--trees", default="", help="comma-separated source trees to compare")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--shapes", default=",".join(f"{e}x{t}x{w}" for e, t, w in SHAPES))
    p.add_argument(
        "--waiters",
        default=",".join(str(w) for w in WAITERS),
        help="comma-separated waiter counts; a count ending in t: each waiter its own tenant",
    )
    p.add_argument("--renewals", default="1000,10000", help="leases per renewal round (Redis)")
    p.add_argument("--pairs", default="", help="admit + release pairs at once (Redis)")
    p.add_argument("--stores", default="memory", help="memory, redis, or both (comma-separated)")
    p.add_argument(
        "--asks",
        default="candidates,grouped",
        help="ask forms: candidates (one per engine), grouped (AdmissionAsk.group)",
    )
    p.add_argument(
        "--retry-groups",
        type=int,
        default=0,
        help="grouped asks: this many more groups named, each of the engines but one",
    )
    p.add_argument("--child", nargs=2, metavar=("KIND", "ARG"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        tree = os.environ.get("KVGW_TREE")
        if tree:  # this tree's `gateway`, not the editable install's
            sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
            sys.path.insert(0, tree)
        print(json.dumps(measure(args.child[0], args.child[1], args.seconds)))
        return 0
    import gateway

    os.environ[RETRY_GROUPS] = str(args.retry_groups)
    trees = [t for t in args.trees.split(",") if t] or [str(Path(gateway.__file__).parents[1])]
    print(f"load average {os.getloadavg()}; trees {trees}")
    stores = {s for s in args.stores.split(",") if s}
    jobs = []
    if "memory" in stores:
        forms = [f for f in args.asks.split(",") if f]
        jobs += [("decisions", f"{s}:{f}") for s in args.shapes.split(",") if s for f in forms]
        jobs += [("release", w) for w in args.waiters.split(",") if w]
    server = None
    if "redis" in stores:
        from gateway.harness import RedisServer

        forms = [f for f in args.asks.split(",") if f]
        jobs += [("redis", f"{s}:{f}") for s in args.shapes.split(",") if s for f in forms]
        jobs += [("redis-release", w) for w in args.waiters.split(",") if w]
        jobs += [("redis-renew", n) for n in args.renewals.split(",") if n]
        jobs += [("redis-pairs", c) for c in args.pairs.split(",") if c]
        server = RedisServer().start()
        os.environ[REDIS_URL] = server.url
    try:
        for kind, arg in jobs:
            for r in range(args.rounds):
                for tree in trees:
                    got = child(tree, kind, arg, args.seconds)
                    print(f"round {r} {Path(tree).name or tree}: {json.dumps(got)}", flush=True)
    finally:
        if server is not None:
            server.stop()
    print(f"load average {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
