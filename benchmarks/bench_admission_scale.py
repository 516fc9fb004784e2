"""Admission at scale (issue 14): the in-process store's `try_admit` against engines, tenants
and waiting requests, and how many decisions one release causes.

    nice -n 0 .venv/bin/python benchmarks/bench_admission_scale.py [--trees A,B] [--rounds 2]
                                                                   [--seconds 3]

Decision cost, for each engines x tenants x waiting shape of the issue's table: a store with
that many engines (8 blocks each way plus room to spare), each tenant admitted one 8-block
lease and every second one released again (all active: holding, or seen within the
window), `waiting` entries in the line (from the tenants in turn, for every engine); then
asks of 8 blocks over all engines from the tenants in turn (an admitted one is released
again, untimed), p50 / p99 of each `try_admit` call. The clock is injected and moves 1 ms
per decision, so nobody ages out of the window.

Decisions per release: `waiters` requests wait in `gateway.scheduler.Scheduler.admit` (one
full engine, each wants all of it); one lease is released and the `try_admit` calls in the
next 50 ms (less than the scheduler's 0.25 s poll) are counted; then the calls in one
second at rest (polls).

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
from pathlib import Path
from typing import Any

SHAPES = ((1, 1, 0), (100, 1, 0), (1, 100, 1000), (100, 10000, 0), (100, 10000, 1000))
WAITERS = (10, 100, 1000)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


async def decisions(engines: int, tenants: int, waiting: int, seconds: float) -> dict[str, Any]:
    from gateway.core.routing import Candidate, Router
    from gateway.core.types import EngineLoad, EngineSpec, EngineView, Footprint, TenantPolicy
    from gateway.state.base import AdmissionAsk, Lease, QueueEntry
    from gateway.state.memory import InMemoryStore

    clock = Clock()
    store = InMemoryStore(Router(), random.Random(0), clock=clock)
    blocks = 8 * (2 * tenants + waiting) // engines + 200
    specs = [
        EngineSpec(f"e{i}", f"http://e{i}", frozenset({"m"}), blocks + 1, 16, 10**6, 10**6)
        for i in range(engines)
    ]
    need = Footprint(8, 1, 128)
    candidates = tuple(Candidate(EngineView(s, EngineLoad()), need) for s in specs)
    names = frozenset(s.name for s in specs)
    policies = [TenantPolicy(name=f"t{i}") for i in range(tenants)]

    def ask(i: int, policy: TenantPolicy) -> AdmissionAsk:
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
        "calls": len(times),
        "p50_us": round(statistics.median(times), 1),
        "p99_us": round(_percentile(times, 0.99), 1),
        "outcomes": outcomes,
    }


async def per_release(waiters: int) -> dict[str, Any]:
    from gateway.core.retry import ReleaseRate
    from gateway.core.routing import Router
    from gateway.core.types import EngineSpec, Footprint
    from gateway.engines.pool import EnginePool
    from gateway.scheduler import Ask, Scheduler
    from gateway.state.base import AdmissionAsk, Lease, Refusal
    from gateway.state.memory import InMemoryStore

    class Counting(InMemoryStore):
        calls = 0

        async def try_admit(self, ask: AdmissionAsk) -> Lease | Refusal:
            self.calls += 1
            return await super().try_admit(ask)

    spec = EngineSpec("e", "http://e", frozenset({"m"}), 101, 16, 10**6, 10**6)  # 100 blocks
    store = Counting(Router(), random.Random(0))
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
        asyncio.ensure_future(sched.admit(Ask(id=f"w{i}", needs={"e": whole})))
        for i in range(waiters)
    ]
    while len(sched.waiting) < waiters:  # noqa: ASYNC110 (the scheduler has no event for it)
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)  # past one poll: the waiters are spread over it
    store.calls = 0
    await sched.release(holder)
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
    return {
        "waiters": waiters,
        "decisions_after_one_release": after_release,
        "admitted_by_it": 1,
        "decisions_per_s_at_rest": at_rest,
    }


def measure(kind: str, arg: str, seconds: float) -> dict[str, Any]:
    import gateway

    if kind == "decisions":
        e, t, w = (int(x) for x in arg.split("x"))
        got = asyncio.run(decisions(e, t, w, seconds))
    else:
        got = asyncio.run(per_release(int(arg)))
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
    p.add_argument("--waiters", default=",".join(str(w) for w in WAITERS))
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

    trees = [t for t in args.trees.split(",") if t] or [str(Path(gateway.__file__).parents[1])]
    print(f"load average {os.getloadavg()}; trees {trees}")
    jobs = [("decisions", s) for s in args.shapes.split(",") if s]
    jobs += [("release", w) for w in args.waiters.split(",") if w]
    for kind, arg in jobs:
        for r in range(args.rounds):
            for tree in trees:
                got = child(tree, kind, arg, args.seconds)
                print(f"round {r} {Path(tree).name or tree}: {json.dumps(got)}", flush=True)
    print(f"load average {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
