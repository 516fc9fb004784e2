"""Fairness of the waiting line, measured on the in-process store with a simulated clock.

    .venv/bin/python loadtest/bench_fairness.py [--seconds 600] [--seed 1]
    .venv/bin/python loadtest/bench_fairness.py --wakeup [--redis-url redis://127.0.0.1:6379/0]

Prints figures; asserts nothing about timing. The same `InMemoryStore` the gateway runs
(`gateway.core.fairqueue` order, no overtaking, per-tenant queue caps, expiry) is driven by a
discrete-event simulation: Poisson arrivals per tenant, each request holding its KV blocks
on one engine for an exponential time; a waiting request is retried whenever capacity is
released, in the order of the line (what the scheduler's waiters do on a change notice).

Scenarios:
1. two equal-weight tenants both overloading the engine — one with small requests offering
   100% of it, one with large requests offering 300% — each tenant's share of the admitted
   KV·time (blocks × seconds held); the same run with the line ordered first come, first
   served for contrast;
2. a quiet tenant at 30% of the engine next to a noisy one at its fair share (50%), then at
   ten times its share (500%), then at 10x with `kv_share: 0.7`: the quiet tenant's p95 queue
   wait, the numbers and the ratios to the baseline.

`--wakeup` measures, on a real Redis, how long a waiter on one replica takes to wake after a
release on another: pub/sub (what `RedisStore` does) against polling.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import platform
import random
import statistics
import time
from dataclasses import dataclass, field

from gateway.core.routing import Candidate, Router
from gateway.core.types import EngineLoad, EngineSpec, EngineView, Footprint, TenantPolicy
from gateway.state.base import AdmissionAsk, Lease, QueueEntry
from gateway.state.memory import InMemoryStore

ENGINE = EngineSpec("e0", "http://e0", frozenset({"m"}), 101, 16, 1000, 4096)  # 100 blocks
MEAN_HOLD_S = 1.0


@dataclass
class Tenant:
    policy: TenantPolicy
    rate: float  # requests per second
    blocks: tuple[int, int]  # uniform range of a request's blocks
    admitted_kv_s: float = 0.0
    waits: list[float] = field(default_factory=list)
    refused: int = 0
    timed_out: int = 0


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
        fifo: bool = False,
        max_length: int = 10_000,
        max_wait_s: float = 60.0,
        warmup_s: float = 60.0,
    ) -> None:
        self.now = 0.0
        self.tenants = tenants
        self.seconds = seconds
        self.warmup_s = warmup_s
        self.rng = random.Random(seed)
        self.fifo = fifo
        self.max_length = max_length
        self.max_wait_s = max_wait_s
        self.store = InMemoryStore(Router(), random.Random(seed), clock=lambda: self.now)
        self.events: list[Event] = []
        self.seq = itertools.count()
        self.waiting: dict[str, tuple[Tenant, AdmissionAsk, float, float]] = {}

    def at(self, when: float, kind: str, payload: object = None) -> None:
        heapq.heappush(self.events, Event(when, next(self.seq), kind, payload))

    def policy_in_line(self, tenant: Tenant) -> TenantPolicy:
        # FIFO for contrast: every request under one tag, so the line is arrival order.
        if self.fifo:
            return TenantPolicy("everyone", max_queued=tenant.policy.max_queued)
        return tenant.policy

    async def run(self) -> None:
        for t in self.tenants:
            self.at(self.rng.expovariate(t.rate), "arrive", t)
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
        self.at(self.now + self.rng.expovariate(tenant.rate), "arrive", tenant)
        blocks = self.rng.randint(*tenant.blocks)
        hold = self.rng.expovariate(1 / MEAN_HOLD_S)
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
            self.start(tenant, got, hold, waited=0.0)
            return
        if not got.waitable:
            tenant.refused += self.now > self.warmup_s
            return
        entry = QueueEntry(ask.lease_id, ask.tenant, frozenset({"e0"}), blocks, self.max_wait_s)
        if await self.store.enqueue(entry, self.max_length) != "queued":
            tenant.refused += self.now > self.warmup_s
            return
        self.waiting[ask.lease_id] = (tenant, ask, hold, self.now)

    def start(self, tenant: Tenant, lease: Lease, hold: float, waited: float) -> None:
        if self.now > self.warmup_s:
            tenant.waits.append(waited)
            tenant.admitted_kv_s += lease.blocks * min(hold, self.seconds - self.now)
        self.at(self.now + hold, "finish", lease)

    async def finish(self, lease: Lease) -> None:
        await self.store.release(lease)
        await self.dispatch()

    async def dispatch(self) -> None:
        """Waiters retry in the order of the line until the head does not fit."""
        await self.store.queue_length()  # expires entries whose time is up
        for entry_id in [e.id for e in self.store._line.in_order()]:
            tenant, ask, hold, since = self.waiting[entry_id]
            got = await self.store.try_admit(AdmissionAsk(**{**_fields(ask), "queued": True}))
            if not isinstance(got, Lease):
                if not got.waitable:  # over its KV share: refused after all (429)
                    await self.store.dequeue(entry_id)
                    tenant.refused += self.now > self.warmup_s
                    del self.waiting[entry_id]
                    continue
                break
            del self.waiting[entry_id]
            self.start(tenant, got, hold, waited=self.now - since)
        for entry_id in [i for i in self.waiting if i not in self.store._line]:
            tenant = self.waiting.pop(entry_id)[0]
            tenant.timed_out += self.now > self.warmup_s


def _fields(ask: AdmissionAsk) -> dict[str, object]:
    return {name: getattr(ask, name) for name in AdmissionAsk.__dataclass_fields__}


def p95(values: list[float]) -> float:
    if len(values) < 20:
        return float("nan")
    return statistics.quantiles(values, n=20)[-1]


def capacity_rate(blocks: tuple[int, int], fraction: float) -> float:
    """Requests per second that occupy `fraction` of the engine's blocks on average."""
    mean_blocks = sum(blocks) / 2
    return fraction * 100 / (mean_blocks * MEAN_HOLD_S)


async def equal_shares(seconds: float, seed: int) -> None:
    print("1. two equal-weight tenants: small requests at 100% of the engine, large at 300%")
    for fifo in (False, True):
        small = Tenant(TenantPolicy("small", max_queued=200), capacity_rate((2, 6), 1.0), (2, 6))
        large = Tenant(
            TenantPolicy("large", max_queued=200), capacity_rate((12, 20), 3.0), (12, 20)
        )
        sim = Simulation([small, large], seconds=seconds, seed=seed, fifo=fifo)
        await sim.run()
        total = small.admitted_kv_s + large.admitted_kv_s
        label = "first come, first served" if fifo else "fair line (SFQ by blocks)"
        print(
            f"   {label:27s} KV·time share: small {small.admitted_kv_s / total:6.1%}"
            f"  large {large.admitted_kv_s / total:6.1%}"
            f"   (admitted {len(small.waits)} / {len(large.waits)} requests;"
            f" timed out {small.timed_out} / {large.timed_out})"
        )


async def quiet_tenant(seconds: float, seed: int) -> None:
    print("2. quiet tenant at 30% of the engine; noisy tenant at its share (50%), then at 10x")
    blocks = (4, 16)
    results = {}
    runs = (("baseline", 0.5, None), ("noisy 10x", 5.0, None), ("+kv_share", 5.0, 0.7))
    for label, noisy_fraction, share in runs:
        quiet = Tenant(TenantPolicy("quiet", max_queued=100), capacity_rate(blocks, 0.3), blocks)
        noisy = Tenant(
            TenantPolicy("noisy", max_queued=100, kv_share=share),
            capacity_rate(blocks, noisy_fraction),
            blocks,
        )
        sim = Simulation([quiet, noisy], seconds=seconds, seed=seed, max_wait_s=30.0)
        await sim.run()
        results[label] = p95(quiet.waits)
        print(
            f"   {label:10s} quiet p95 wait {results[label] * 1000:7.1f} ms"
            f" (mean {statistics.fmean(quiet.waits) * 1000:6.1f} ms, {len(quiet.waits)} admitted,"
            f" refused {quiet.refused}, timed out {quiet.timed_out});"
            f" noisy p95 {p95(noisy.waits) * 1000:8.1f} ms, refused {noisy.refused}"
        )
    ratio = results["noisy 10x"] / results["baseline"]
    print(f"   ratio (noisy 10x / baseline): {ratio:.2f}")
    ratio = results["+kv_share"] / results["baseline"]
    print(f"   ratio (noisy 10x with kv_share 0.7 / baseline): {ratio:.2f}")


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
    parser.add_argument("--seconds", type=float, default=600.0, help="simulated seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--wakeup", action="store_true", help="measure Redis wake-up instead")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--trials", type=int, default=500)
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}"
    )
    if args.wakeup:
        asyncio.run(wakeup(args.redis_url, args.trials))
        return
    print(
        f"engine: 100 blocks; holds exponential, mean {MEAN_HOLD_S} s; {args.seconds:g} s simulated"
    )
    started = time.perf_counter()
    asyncio.run(equal_shares(args.seconds, args.seed))
    asyncio.run(quiet_tenant(args.seconds, args.seed))
    print(f"({time.perf_counter() - started:.1f} s wall)")


if __name__ == "__main__":
    main()
