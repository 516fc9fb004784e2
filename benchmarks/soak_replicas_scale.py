"""Soak at scale (issue 14): several replica processes sharing one Redis, many engines, many
tenants, a long line; the replica invariants checked all along.

    .venv/bin/python benchmarks/soak_replicas_scale.py [--replicas 3] [--engines 100]
        [--tenants 10000] [--clients 350] [--seconds 120] [--kill-at 60] [--burst-blocks 256]
        [--json F]

A private `redis-server` (`gateway.harness.RedisServer`) and `--replicas` child processes,
each a `RedisStore` with a `gateway.scheduler.Scheduler` over the same `--engines` engines
(64 blocks and 16 sequences each, figures only: no HTTP, this is the state's soak) and
`--clients` client loops: each request asks 1-16 blocks (one sequence) on every engine,
holds its lease for an exponential time of mean `--hold-s`, and releases it. 80 % of the
loops draw a tenant uniformly from `--tenants` (`max_concurrency` 2 each); 20 % belong to ten
flooding tenants (no limit), so the line stays long and the fair order has work to do.

Checked by the parent every 0.2 s, reading Redis as the scripts keep it: no engine's
reserved blocks above its capacity or sequences above its `max_num_seqs` (no over-commit),
no tenant above its concurrency (limits across replicas), the engine order Redis keeps for
grouped asks in agreement with the reserved load (`order_broken`). Replica 0 is SIGKILLed at
`--kill-at` s (nothing released, nothing renewed). At the end, after the leases' TTL: no
lease, reservation, tenant counter or queue entry left (zero leaks). Fairness: what each
class was admitted and how long it waited (p50 / p95); ten flooders among thousands of
active light tenants have a small weighted share, so they should get far less than their
20 % of the loops, and the light tenants should wait less.
Prints figures (and writes them with `--json`); exits 1 if an invariant failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

CAPACITY_BLOCKS = 64
MAX_SEQS = 16
PREFIX = "soak"
FLOODERS = 10
LEASE_TTL_S = 3.0


def _specs(engines: int) -> list[Any]:
    from gateway.core.types import EngineSpec

    # num_gpu_blocks counts vLLM's null block: 65 → 64 usable.
    return [
        EngineSpec(
            f"e{i}", f"http://e{i}", frozenset({"m"}), CAPACITY_BLOCKS + 1, 16, MAX_SEQS, 4096
        )
        for i in range(engines)
    ]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def replica(index: int, args: argparse.Namespace, url: str) -> dict[str, Any]:
    from gateway.core.retry import ReleaseRate
    from gateway.core.routing import DEFAULT_SCORERS
    from gateway.core.types import Footprint, TenantPolicy
    from gateway.engines.pool import EnginePool
    from gateway.errors import GatewayError
    from gateway.scheduler import Ask, Scheduler
    from gateway.state.redis import RedisStore

    specs = _specs(args.engines)
    store = RedisStore(
        url,
        DEFAULT_SCORERS,
        replica_id=f"r{index}",
        key_prefix=PREFIX,
        lease_ttl_s=LEASE_TTL_S,
        timeout_s=10.0,
        burst_blocks=args.burst_blocks,
    )
    sched = Scheduler(
        store=store,
        pool=EnginePool(specs),
        kv_ceiling=1.0,
        max_length=100_000,
        max_wait_s=30.0,
        retry_fallback_s=1.0,
        rate=ReleaseRate(10.0),
    )
    rng = random.Random(index)
    light = {i: TenantPolicy(f"t{i}", max_concurrency=2) for i in range(args.tenants)}
    floods = [TenantPolicy(f"flood{i}") for i in range(FLOODERS)]
    waits: dict[str, list[float]] = {"light": [], "flood": []}
    refused: dict[str, dict[str, int]] = {"light": {}, "flood": {}}
    deadline = time.monotonic() + args.seconds

    async def client(flooder: bool) -> None:
        while time.monotonic() < deadline:
            tenant = rng.choice(floods) if flooder else light[rng.randrange(args.tenants)]
            blocks = rng.randint(1, 16)
            need = Footprint(blocks, 1, blocks * 16)
            ask = Ask(id=uuid.uuid4().hex, needs={s.name: need for s in specs}, tenant=tenant)
            t0 = time.monotonic()
            try:
                lease = await sched.admit(ask)
            except GatewayError as e:
                code = e.code or type(e).__name__
                kind = refused["flood" if flooder else "light"]
                kind[code] = kind.get(code, 0) + 1
                await asyncio.sleep(0.1)
                continue
            waits["flood" if flooder else "light"].append(time.monotonic() - t0)
            await asyncio.sleep(rng.expovariate(1 / args.hold_s))
            await sched.release(lease)

    floods_n = args.clients // 5
    started = time.monotonic()
    await asyncio.gather(*(client(i < floods_n) for i in range(args.clients)))
    elapsed = time.monotonic() - started
    await store.close()
    return {
        "admitted_per_s": round(sum(len(v) for v in waits.values()) / elapsed, 1),
        "replica": index,
        "admitted": {k: len(v) for k, v in waits.items()},
        "wait_p50_s": {k: round(_percentile(v, 0.5), 3) for k, v in waits.items()},
        "wait_p95_s": {k: round(_percentile(v, 0.95), 3) for k, v in waits.items()},
        "refused": refused,
    }


def order_broken(client: Any) -> list[str]:
    """Where the engine order Redis keeps for grouped asks (docs/engine-index.md) disagrees
    with the ledger: read in one MULTI, each engine's place in each group must show its
    capacity less its reserved blocks (no foreign load here), its running sequences, and be
    in the group's sorted set exactly when it could take a one-sequence request."""
    pipe = client.pipeline(transaction=True)
    for key in ("load", "grp", "gord"):
        if key == "gord":
            pipe.zrange(f"{{{PREFIX}}}:{key}", 0, -1)
        else:
            pipe.hgetall(f"{{{PREFIX}}}:{key}")
    load_raw, grp, gord = pipe.execute()
    load = {k.decode(): int(v) for k, v in load_raw.items()}
    members = {m.decode() for m in gord}
    broken, placed = [], set()
    for field, value in grp.items():
        group, sep, engine = field.decode().partition("\0")
        if not sep:
            continue
        spec, _, rest = value.decode().partition("|")
        clipped, kind, member = rest.split("|", 2)
        cap, seqs, staged = (int(x) for x in spec.split(","))
        free = cap - load.get(f"b:{engine}", 0)
        running = load.get(f"s:{engine}", 0)
        if int(clipped) != max(0, free):
            broken.append(f"order {group[:8]} {engine}: free {clipped}, ledger {free}")
        want = f"{group}\0{1e11 - free:012.0f}{running:07.0f}{int(kind):05.0f}\0{engine}"
        if running < seqs + staged and member != want:
            broken.append(f"order {group[:8]} {engine}: member {member!r}, ledger {want!r}")
        if running >= seqs + staged and member:
            broken.append(f"order {group[:8]} {engine}: full but ranked")
        if member:
            placed.add(member)
            if member not in members:
                broken.append(f"order {group[:8]} {engine}: {member!r} not in the sorted set")
    if members - placed:
        broken.append(f"order: {len(members - placed)} members of no engine's place")
    return broken


def check(client: Any, specs: list[Any], limits: int) -> list[str]:
    """What the shared state shows now that breaks an invariant."""
    broken = order_broken(client)
    load = {k.decode(): int(v) for k, v in client.hgetall(f"{{{PREFIX}}}:load").items()}
    for s in specs:
        if load.get(f"b:{s.name}", 0) > CAPACITY_BLOCKS:
            broken.append(f"{s.name}: {load[f'b:{s.name}']} blocks reserved > {CAPACITY_BLOCKS}")
        if load.get(f"s:{s.name}", 0) > MAX_SEQS:
            broken.append(f"{s.name}: {load[f's:{s.name}']} sequences > {MAX_SEQS}")
    for k, v in client.hgetall(f"{{{PREFIX}}}:ten").items():
        name = k.decode()
        if name.startswith("n:t") and int(v) > limits:
            broken.append(f"tenant {name[2:]}: {int(v)} in flight > {limits}")
    return broken


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="soak_replicas_scale.py", description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--engines", type=int, default=100)
    p.add_argument("--tenants", type=int, default=10_000)
    p.add_argument("--clients", type=int, default=350, help="client loops per replica")
    p.add_argument("--hold-s", type=float, default=2.0)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--burst-blocks", type=float, default=256.0, help="the line's burst credit")
    p.add_argument("--kill-at", type=float, default=60.0, help="SIGKILL replica 0 then (0: never)")
    p.add_argument("--json", type=Path)
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(asyncio.run(replica(args.child, args, args.url))), flush=True)
        return 0

    import redis

    from gateway.harness import RedisServer

    server = RedisServer().start()
    client = redis.Redis.from_url(server.url)
    specs = _specs(args.engines)
    passed = [
        *("--engines", str(args.engines), "--tenants", str(args.tenants)),
        *("--clients", str(args.clients), "--hold-s", str(args.hold_s)),
        *("--seconds", str(args.seconds), "--burst-blocks", str(args.burst_blocks)),
    ]
    children = [
        subprocess.Popen(
            [sys.executable, __file__, *passed, "--child", str(i), "--url", server.url],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(args.replicas)
    ]
    print(f"load average {os.getloadavg()}; {args}", flush=True)
    broken: list[str] = []
    samples, peak_blocks, peak_line, killed = 0, 0, 0, False
    t0 = time.monotonic()
    try:
        while any(c.poll() is None for c in children[1 if killed else 0 :]):
            time.sleep(0.2)
            now = time.monotonic() - t0
            if args.kill_at and not killed and now >= args.kill_at:
                children[0].send_signal(signal.SIGKILL)
                killed = True
                print(f"t={now:.1f} s: replica 0 SIGKILLed", flush=True)
            got = check(client, specs, limits=2)
            broken += got
            samples += 1
            load = client.hgetall(f"{{{PREFIX}}}:load")
            peak_blocks = max(
                peak_blocks, sum(int(v) for k, v in load.items() if k.startswith(b"b:"))
            )
            peak_line = max(peak_line, client.zcard(f"{{{PREFIX}}}:qexp"))
        results = [
            json.loads(c.stdout.read().splitlines()[-1]) for c in children[1 if killed else 0 :]
        ]
        time.sleep(LEASE_TTL_S + 1.0)  # the dead replica's leases and entries expire
        leftovers = _leftovers(server.url)
        # The order after everything was released and reaped: every engine back at the top.
        order_end = order_broken(client)
        order_size = client.zcard(f"{{{PREFIX}}}:gord")
        client.close()
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
        server.stop()
    summary = {
        "load_average_end": os.getloadavg(),
        "checks": samples,
        "violations": broken[:20],
        "violation_count": len(broken),
        "peak_reserved_blocks": peak_blocks,
        "capacity_blocks": CAPACITY_BLOCKS * args.engines,
        "peak_line": peak_line,
        "leftovers": leftovers,
        "order_at_end": order_end[:20],
        "order_members_at_end": order_size,
        "replicas": results,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0 if not broken and not order_end and not any(leftovers.values()) else 1


def _leftovers(url: str) -> dict[str, int]:
    """What the shared state still holds once every lease's TTL is over (a store's call
    reaps first)."""
    from gateway.core.routing import DEFAULT_SCORERS
    from gateway.state.base import Lease
    from gateway.state.redis import RedisStore

    async def run() -> dict[str, int]:
        store = RedisStore(url, DEFAULT_SCORERS, replica_id="checker", key_prefix=PREFIX)
        try:
            await store.release(Lease(id="none", engine="", blocks=0, seqs=0))
            await store.queue_length()  # expires the dead replica's entries
            totals = await store.totals()
            return {
                "leases": totals.leases,
                "queued": totals.queued,
                "reserved_blocks": totals.reserved_blocks,
                "reserved_seqs": totals.reserved_seqs,
                "tenants_in_flight": sum(totals.tenant_in_flight.values()),
            }
        finally:
            await store.close()

    return asyncio.run(run())


if __name__ == "__main__":
    raise SystemExit(main())
