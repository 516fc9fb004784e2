"""Fairness of the waiting line, measured on the in-process store with a simulated clock.

    .venv/bin/python benchmarks/bench_fairness.py [--seconds 3600] [--seeds 1-5]
                                                [--burst-blocks 32] [--headroom 0.2]
                                                [--kv-share-variant]
    .venv/bin/python benchmarks/bench_fairness.py --wakeup [--redis-url URL]

(`--wakeup` measures a private redis-server on a free port unless `--redis-url` names one.)

Prints figures; asserts nothing about timing. The same `InMemoryStore` the gateway runs
(`gateway.core.fairqueue` order with its burst credit, `gateway.core.headroom`, no
overtaking, per-tenant queue caps, expiry) is driven by a discrete-event simulation:
Poisson arrivals per tenant, each request holding its KV blocks on one engine for an
exponential time; every waiting request is retried whenever capacity is released, in the
order of the line (what the scheduler's waiters do on a change notice).
Seeds run in parallel processes.

Scenarios (per seed):
1. two equal-weight tenants both overloading the engine — one with small requests offering
   100% of it, one with large requests offering 300% — each tenant's share of the admitted
   KV·time (blocks × seconds held); the same run with the line ordered first come, first
   served for contrast;
2. a quiet tenant at 30% of the engine next to a noisy one at its fair share (50%: the
   baseline), then at ten times its share (500%): the quiet tenant's p95 queue wait in both
   and the ratio. `--kv-share-variant` adds the 10x run with `kv_share: 0.7` on the noisy
   tenant.

What makes the comparison fair:
- every tenant draws its arrivals, sizes and hold times from its own random stream (seeded
  by the seed and the tenant's name), so the quiet tenant sends exactly the same requests at
  exactly the same times in the baseline and the overload runs: only the noisy tenant differs;
- a wait is measured from arrival to admission (0 when admitted at once), for the requests
  that arrive between the warm-up (60 s) and `max_wait_s` (30 s) before the end, so every
  one of them has an outcome; a quiet request refused or timed out counts as an infinite
  wait (none were, in the runs in docs/state.md);
- one hour simulated per run by default: ~9,900 quiet requests per p95.

`--wakeup` measures, on a real Redis, how long a waiter on one replica takes to wake after a
release on another: pub/sub (what `RedisStore` does) against polling.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import math
import os
import platform
import random
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from gateway.core.fairqueue import BURST_BLOCKS
from gateway.core.headroom import HEADROOM
from gateway.core.routing import Candidate, Router
from gateway.core.types import EngineLoad, EngineSpec, EngineView, Footprint, TenantPolicy
from gateway.state.base import AdmissionAsk, Lease, QueueEntry
from gateway.state.memory import InMemoryStore

ENGINE = EngineSpec("e0", "http://e0", frozenset({"m"}), 101, 16, 1000, 4096)  # 100 blocks
MEAN_HOLD_S = 1.0
WARMUP_S = 60.0


@dataclass
class Tenant:
    policy: TenantPolicy
    rate: float  # requests per second
    blocks: tuple[int, int]  # uniform range of a request's blocks
    seed: int
    admitted_kv_s: float = 0.0
    waits: list[float] = field(default_factory=list)
    refused: int = 0
    timed_out: int = 0

    def __post_init__(self) -> None:
        # The tenant's own stream: its requests do not depend on anyone else's.
        self.rng = random.Random(f"{self.seed}:{self.policy.name}")


@dataclass(order=True)
class Event:
    at: float
    seq: int
    kind: str = field(compare=False)
    payload: object = field(compare=False, default=None)


class Simulation:
    def __init__(
        self,
        tenants: list[Tenant],
        *,
        seconds: float,
        seed: int,
        burst_blocks: float,
        headroom: float = HEADROOM,
        fifo: bool = False,
        max_length: int = 10_000,
        max_wait_s: float = 60.0,
    ) -> None:
        self.now = 0.0
        self.tenants = tenants
        self.seconds = seconds
        self.fifo = fifo
        self.max_length = max_length
        self.max_wait_s = max_wait_s
        # Requests arriving in this window are measured; each has an outcome by the end.
        self.measured = (WARMUP_S, seconds - max_wait_s)
        self.store = InMemoryStore(
            Router(),
            random.Random(seed),
            clock=lambda: self.now,
            burst_blocks=burst_blocks,
            headroom=headroom,
        )
        self.events: list[Event] = []
        self.seq = itertools.count()
        self.waiting: dict[str, tuple[Tenant, AdmissionAsk, float, float]] = {}

    def at(self, when: float, kind: str, payload: object = None) -> None:
        heapq.heappush(self.events, Event(when, next(self.seq), kind, payload))

    def counts(self, arrived: float) -> bool:
        return self.measured[0] <= arrived < self.measured[1]

    def policy_in_line(self, tenant: Tenant) -> TenantPolicy:
        # FIFO for contrast: every request under one tag, so the line is arrival order.
        if self.fifo:
            return TenantPolicy("everyone", max_queued=tenant.policy.max_queued)
        return tenant.policy

    async def run(self) -> None:
        for t in self.tenants:
            self.at(t.rng.expovariate(t.rate), "arrive", t)
        while self.events:
            event = heapq.heappop(self.events)
            if event.at > self.seconds:
                break
            self.now = event.at
            if event.kind == "arrive":
                await self.arrive(event.payload)  # type: ignore[arg-type]
            else:
                await self.finish(event.payload)  # type: ignore[arg-type]

    async def arrive(self, tenant: Tenant) -> None:
        self.at(self.now + tenant.rng.expovariate(tenant.rate), "arrive", tenant)
        blocks = tenant.rng.randint(*tenant.blocks)
        hold = tenant.rng.expovariate(1 / MEAN_HOLD_S)
        share = tenant.policy.kv_share
        ask = AdmissionAsk(
            lease_id=f"r{next(self.seq)}",
            candidates=(Candidate(EngineView(ENGINE, EngineLoad()), Footprint(blocks, 1, 0)),),
            kv_ceiling=1.0,
            tenant=self.policy_in_line(tenant),
            tenant_max_blocks=None if share is None else int(100 * share),
        )
        got = await self.store.try_admit(ask)
        if isinstance(got, Lease):
            self.start(tenant, got, hold, arrived=self.now)
            return
        if not got.waitable:
            self.refuse(tenant, self.now)
            return
        entry = QueueEntry(ask.lease_id, ask.tenant, frozenset({"e0"}), blocks, self.max_wait_s)
        if await self.store.enqueue(entry, self.max_length) != "queued":
            self.refuse(tenant, self.now)
            return
        self.waiting[ask.lease_id] = (tenant, ask, hold, self.now)

    def refuse(self, tenant: Tenant, arrived: float) -> None:
        if self.counts(arrived):
            tenant.refused += 1
            tenant.waits.append(math.inf)

    def start(self, tenant: Tenant, lease: Lease, hold: float, arrived: float) -> None:
        if self.counts(arrived):
            tenant.waits.append(self.now - arrived)
        if self.now > WARMUP_S:
            tenant.admitted_kv_s += lease.blocks * min(hold, self.seconds - self.now)
        self.at(self.now + hold, "finish", lease)

    async def finish(self, lease: Lease) -> None:
        await self.store.release(lease)
        await self.dispatch()

    async def dispatch(self) -> None:
        """Every waiter retries, in the order of the line (what the scheduler's waiters do on
        a change notice). A tenant's later entries are not tried once one of its entries was
        refused: its own earlier entry is ahead of them (no overtaking), so they would be too."""
        await self.store.queue_length()  # expires entries whose time is up
        refused: set[str] = set()
        for entry_id in [e.id for e in self.store._line.in_order()]:
            tenant, ask, hold, since = self.waiting[entry_id]
            if tenant.policy.name in refused:
                continue
            got = await self.store.try_admit(AdmissionAsk(**{**_fields(ask), "queued": True}))
            if not isinstance(got, Lease):
                if not got.waitable:  # over its KV share: refused after all (429)
                    await self.store.dequeue(entry_id)
                    del self.waiting[entry_id]
                    self.refuse(tenant, since)
                    continue
                refused.add(tenant.policy.name)
                if len(refused) == len(self.tenants):
                    break
                continue
            del self.waiting[entry_id]
            self.start(tenant, got, hold, arrived=since)
        for entry_id in [i for i in self.waiting if i not in self.store._line]:
            tenant, _, _, since = self.waiting.pop(entry_id)
            if self.counts(since):
                tenant.timed_out += 1
                tenant.waits.append(math.inf)


def _fields(ask: AdmissionAsk) -> dict[str, object]:
    return {name: getattr(ask, name) for name in AdmissionAsk.__dataclass_fields__}


def p95(values: list[float]) -> float:
    """The 95th percentile (nearest rank); inf when more than 5% never got in."""
    if len(values) < 100:
        return math.nan
    ordered = sorted(values)
    return ordered[math.ceil(0.95 * len(ordered)) - 1]


def capacity_rate(blocks: tuple[int, int], fraction: float) -> float:
    """Requests per second that occupy `fraction` of the engine's blocks on average."""
    mean_blocks = sum(blocks) / 2
    return fraction * 100 / (mean_blocks * MEAN_HOLD_S)


def equal_shares(
    seconds: float, seed: int, burst_blocks: float, headroom: float
) -> dict[str, object]:
    """Scenario 1 for one seed: KV·time shares, fair line and first come, first served."""
    out: dict[str, object] = {}
    for fifo in (False, True):
        small = Tenant(
            TenantPolicy("small", max_queued=200), capacity_rate((2, 6), 1.0), (2, 6), seed
        )
        large = Tenant(
            TenantPolicy("large", max_queued=200), capacity_rate((12, 20), 3.0), (12, 20), seed
        )
        sim = Simulation(
            [small, large],
            seconds=seconds,
            seed=seed,
            burst_blocks=burst_blocks,
            headroom=headroom,
            fifo=fifo,
        )
        asyncio.run(sim.run())
        total = small.admitted_kv_s + large.admitted_kv_s
        out["fifo" if fifo else "fair"] = (
            small.admitted_kv_s / total,
            large.admitted_kv_s / total,
            small.timed_out + small.refused,
            large.timed_out + large.refused,
        )
    return out


def quiet_tenant(
    seconds: float, seed: int, burst_blocks: float, headroom: float, kv_share_variant: bool
) -> dict[str, object]:
    """Scenario 2 for one seed: the quiet tenant's waits beside the noisy one."""
    blocks = (4, 16)
    runs = [("baseline", 0.5, None), ("noisy 10x", 5.0, None)]
    if kv_share_variant:
        runs.append(("10x kv_share 0.7", 5.0, 0.7))
    out: dict[str, object] = {}
    for label, noisy_fraction, share in runs:
        quiet = Tenant(
            TenantPolicy("quiet", max_queued=100), capacity_rate(blocks, 0.3), blocks, seed
        )
        noisy = Tenant(
            TenantPolicy("noisy", max_queued=100, kv_share=share),
            capacity_rate(blocks, noisy_fraction),
            blocks,
            seed,
        )
        sim = Simulation(
            [quiet, noisy],
            seconds=seconds,
            seed=seed,
            burst_blocks=burst_blocks,
            headroom=headroom,
            max_wait_s=30.0,
        )
        asyncio.run(sim.run())
        finite = [w for w in quiet.waits if w < math.inf]
        out[label] = {
            "p95": p95(quiet.waits),
            "mean": statistics.fmean(finite) if finite else math.nan,
            "waited": sum(1 for w in finite if w > 0) / max(1, len(quiet.waits)),
            "n": len(quiet.waits),
            "lost": quiet.refused + quiet.timed_out,
            "noisy_p95": p95([w for w in noisy.waits if w < math.inf]),
            # The engine's blocks in use, averaged after the warm-up (what headroom costs).
            "used": (quiet.admitted_kv_s + noisy.admitted_kv_s) / (100 * (seconds - WARMUP_S)),
        }
    return out


def one_seed(
    args: tuple[float, int, float, float, bool],
) -> tuple[int, dict[str, object], float]:
    seconds, seed, burst_blocks, headroom, variant = args
    started = time.perf_counter()
    result = {
        "shares": equal_shares(seconds, seed, burst_blocks, headroom),
        "quiet": quiet_tenant(seconds, seed, burst_blocks, headroom, variant),
    }
    return seed, result, time.perf_counter() - started


def seeds_arg(text: str) -> list[int]:
    """'1-5' or '1,3,7'."""
    if "-" in text:
        low, high = text.split("-", 1)
        return list(range(int(low), int(high) + 1))
    return [int(x) for x in text.split(",")]


def fairness(
    seconds: float, seeds: list[int], burst_blocks: float, headroom: float, variant: bool
) -> None:
    jobs = [(seconds, seed, burst_blocks, headroom, variant) for seed in seeds]
    workers = min(len(jobs), os.cpu_count() or 1)
    with ProcessPoolExecutor(workers) as pool:
        results = sorted(pool.map(one_seed, jobs))
    print("1. two equal-weight tenants, both overloading: small requests (2-6 blocks) at 100%")
    print("   of the engine, large (12-20) at 300%. Share of the admitted KV·time:")
    print("   seed | fair line: small / large | first come, first served: small / large")
    for seed, r, _ in results:
        shares: dict[str, tuple[float, float, int, int]] = r["shares"]  # type: ignore[assignment]
        fair, fifo = shares["fair"], shares["fifo"]
        print(
            f"   {seed:4d} | {fair[0]:6.1%} / {fair[1]:6.1%}{'':12s}"
            f"| {fifo[0]:6.1%} / {fifo[1]:6.1%}"
        )
    print()
    print("2. quiet tenant at 30% of the engine (4-16 blocks); noisy tenant at its share (50%,")
    print("   the baseline), then at ten times it (500%). Quiet tenant's queue wait, p95:")
    header = "   seed | baseline p95 | noisy 10x p95 | ratio | (mean wait, share that waited:"
    print(
        header + " baseline / 10x; quiet requests measured; noisy admitted p95 at 10x;"
        " engine in use at 10x)"
    )
    worst = 0.0
    for seed, r, _ in results:
        q: dict[str, dict[str, float]] = r["quiet"]  # type: ignore[assignment]
        base, loud = q["baseline"], q["noisy 10x"]
        ratio = loud["p95"] / base["p95"]
        worst = max(worst, ratio)
        lost = (
            f"; lost {base['lost']:.0f} / {loud['lost']:.0f}"
            if base["lost"] or loud["lost"]
            else ""
        )
        print(
            f"   {seed:4d} | {base['p95'] * 1000:9.0f} ms | {loud['p95'] * 1000:10.0f} ms |"
            f" {ratio:5.2f} | ({base['mean'] * 1000:.0f} / {loud['mean'] * 1000:.0f} ms,"
            f" {base['waited']:.0%} / {loud['waited']:.0%}; n {base['n']:.0f} / {loud['n']:.0f};"
            f" noisy {loud['noisy_p95']:.1f} s; used {loud['used']:.0%}{lost})"
        )
        if "10x kv_share 0.7" in q:
            v = q["10x kv_share 0.7"]
            print(
                f"        |   with kv_share 0.7 on the noisy tenant: {v['p95'] * 1000:.0f} ms,"
                f" ratio {v['p95'] / base['p95']:.2f}"
            )
    print(f"   worst ratio over {len(results)} seeds: {worst:.2f} (target: at most 1.20)")
    wall = ", ".join(f"{w:.0f}" for _, _, w in results)
    print(f"(wall per seed: {wall} s, {workers} in parallel)")


async def wakeup(url: str, trials: int) -> None:
    """A waiter on replica B; a release on replica A: time until B's waiter returns."""
    import uuid

    import redis.asyncio as aioredis

    from gateway.state.redis import RedisStore

    prefix = f"kvgw-bench-{uuid.uuid4().hex[:8]}"
    one = RedisStore(url, ["most_free_blocks"], replica_id="a", key_prefix=prefix)
    other = RedisStore(url, ["most_free_blocks"], replica_id="b", key_prefix=prefix)
    cand = (Candidate(EngineView(ENGINE, EngineLoad()), Footprint(1, 1, 0)),)
    latencies: list[float] = []
    admit_s: list[float] = []
    try:
        await other.wait_for_change(0.3)
        await asyncio.sleep(0.2)
        for i in range(trials):
            t0 = time.perf_counter()
            lease = await one.try_admit(AdmissionAsk(f"w{i}", cand, 1.0))
            admit_s.append(time.perf_counter() - t0)
            assert isinstance(lease, Lease)
            await asyncio.sleep(0.005)  # let the admission's notices (if any) pass
            waiter = asyncio.create_task(other.wait_for_change(5.0))
            await asyncio.sleep(0.005)
            start = time.perf_counter()
            await one.release(lease)
            await waiter
            latencies.append(time.perf_counter() - start)
    finally:
        await one.close()
        await other.close()
        client = aioredis.from_url(url)
        keys = [k async for k in client.scan_iter(match=f"{{{prefix}}}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
    ms = sorted(x * 1000 for x in latencies)
    print(f"cross-replica wake-up over {trials} releases (Redis {url}):")
    print(
        f"   pub/sub: median {statistics.median(ms):.2f} ms, p95 {ms[int(0.95 * len(ms))]:.2f} ms,"
        f" max {ms[-1]:.2f} ms"
    )
    print(
        "   polling every P s instead: mean P/2, worst P (scheduler POLL_S = 0.25 → 125 / 250 ms)"
    )
    adm = sorted(x * 1000 for x in admit_s)
    print(f"   one admission round trip (Lua script): median {statistics.median(adm):.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3600.0, help="simulated s per run")
    parser.add_argument("--seeds", type=seeds_arg, default=seeds_arg("1-5"), help="1-5 or 1,3")
    parser.add_argument(
        "--burst-blocks",
        type=float,
        default=BURST_BLOCKS,
        help=f"the line's burst credit B in blocks (default {BURST_BLOCKS}; 0: plain SFQ)",
    )
    parser.add_argument(
        "--headroom",
        type=float,
        default=HEADROOM,
        help=f"capacity kept from tenants above their share (default {HEADROOM}; 0: off)",
    )
    parser.add_argument(
        "--kv-share-variant", action="store_true", help="add the 10x run with kv_share 0.7"
    )
    parser.add_argument("--wakeup", action="store_true", help="measure Redis wake-up instead")
    parser.add_argument(
        "--redis-url", help="the Redis to measure (default: a private redis-server on a free port)"
    )
    parser.add_argument("--trials", type=int, default=500)
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs,"
        f" Python {platform.python_version()}"
    )
    if args.wakeup:
        if args.redis_url:
            asyncio.run(wakeup(args.redis_url, args.trials))
        else:
            from gateway.harness import RedisServer

            with RedisServer() as private:
                asyncio.run(wakeup(private.url, args.trials))
        return
    print(
        f"engine: 100 blocks; holds exponential, mean {MEAN_HOLD_S} s; {args.seconds:g} s"
        f" simulated per run; burst credit B = {args.burst_blocks:g} blocks;"
        f" headroom {args.headroom:g}; seeds {args.seeds}"
    )
    print()
    started = time.perf_counter()
    fairness(args.seconds, args.seeds, args.burst_blocks, args.headroom, args.kv_share_variant)
    print(f"({time.perf_counter() - started:.0f} s wall)")


if __name__ == "__main__":
    main()
