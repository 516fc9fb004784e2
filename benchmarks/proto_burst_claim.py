"""A prototype, not the gateway's rule: what a *burst claim* would change in issue 18's
fairness scenario (a), on the simulated clock of tests/state/test_fairness_scenario.py.

    .venv/bin/python benchmarks/proto_burst_claim.py [--seeds 1,2,3] [--spread 0.5]

Today's headroom rule (gateway/core/headroom.py) keeps free, for an admission that takes
its tenant above its share, what the other active tenants lack of their shares (their
unused shares); an admission within its tenant's share is never held back. A quiet
tenant at a third of its share that has two 58-block requests running (116 of its 121
blocks) therefore has an unused share of 5 blocks, the flooder holds its own two, and the
quiet tenant's third request waits for one of the four to end (docs/benchmarks.md,
"Fairness under load, end to end").

The burst claim: an active tenant whose recent usage leaves room for one more request of
the size of its last within its share (`average + need <= share`) claims that request's
blocks; the pool keeps free, for an admission above its tenant's share, the sum over the
other tenants of `max(unused share, claim)` (instead of the unused shares), and for an
admission within its tenant's share (a tenant already holding), what the claims exceed
the unused shares by (`max(0, claim - unused share)`: nonzero only for a tenant near its
share). The prototype patches the in-process store's rule (`_Headroom.allows`) and
visits every tenant; the scalable form is described in docs/benchmarks.md.

Prints, per seed and service-time spread, today's rule against the burst claim: (a) the
quiet tenant's p95 wait flooded against its bound (1.2 x alone + 0.3 service times), (b)
its p95 flooded against its static partition's and its failed requests, and the flooder's
requests served per second in both. Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tests.state.test_fairness_scenario as scenario
from gateway.core import headroom as room
from gateway.core.routing import Candidate
from gateway.state import memory

TODAY = memory._Headroom.allows


def claims(rule: Any, need: int) -> tuple[float, float]:
    """(what the other tenants' claims exceed their unused shares by, the sum of
    max(unused share, claim)) for an ask of `need` blocks."""
    store, total = rule.store, rule.ask.tenant.weight + rule.others
    extra = reserve = 0.0
    for name, record in store._activity._records.items():
        if name == rule.ask.tenant.name:
            continue
        held = store.tenant_blocks(name)
        share = record.weight / total * rule.pool
        last = store._last_need.get(name, need)
        claim = last if store.average(name, rule.now) + last <= share else 0.0
        unused = max(0.0, share - held)
        extra += max(0.0, claim - unused)
        reserve += max(unused, claim)
    return extra, reserve


def burst_claim(rule: Any, c: Candidate) -> bool:
    if not TODAY(rule, c):
        return False
    if rule.store.headroom <= 0 or rule.others <= 0 or rule.held == 0:
        return True  # alone, the rule off, or a tenant's first request: as today
    extra, reserve = claims(rule, c.need.blocks)
    free_after = rule.pool_free - c.need.blocks
    over = room.over_share(
        held=rule.held,
        need=c.need.blocks,
        average=rule.mine,
        weight=rule.ask.tenant.weight,
        total=rule.ask.tenant.weight + rule.others,
        capacity=rule.pool,
    )
    return free_after >= (reserve if over else extra)


class Seeded(scenario.Tenant):
    seed = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(f"18:{self.name}:{self.seed}" if self.seed else f"18:{self.name}")


def patch_service(spread: float, seed: int) -> None:
    """Service times uniform in (1 ± spread) service times (0: fixed, as the test)."""
    rng = random.Random(seed)

    def admitted(self: scenario.Run, tenant: scenario.Tenant, lease: Any, since: float) -> None:
        if self.measured(since):
            tenant.waits.append(self.now - since)
        service = scenario.SERVICE_S * (rng.uniform(1 - spread, 1 + spread) if spread else 1)
        self.at(self.now + service, "finish", lease)

    scenario.Run.admitted = admitted  # type: ignore[method-assign]


def remember_needs() -> None:
    """The store remembers each tenant's last request size (the claim's size)."""
    original = memory.InMemoryStore.try_admit

    async def try_admit(self: Any, ask: Any) -> Any:
        if not hasattr(self, "_last_need"):
            self._last_need = {}
        got = await original(self, ask)
        self._last_need[ask.tenant.name] = max(c.need.blocks for c in ask.candidates)
        return got

    memory.InMemoryStore.try_admit = try_admit  # type: ignore[method-assign]


async def one(rule: Callable[[Any, Candidate], bool], seed: int, spread: float) -> dict[str, float]:
    memory._Headroom.allows = rule  # type: ignore[method-assign]
    Seeded.seed = seed
    out: dict[str, float] = {}
    for name, rate, flood, engine in [
        ("a_alone", scenario.QUIET_A, False, scenario.WHOLE),
        ("a_flood", scenario.QUIET_A, True, scenario.WHOLE),
        ("b_part", scenario.QUIET_B, False, scenario.HALF),
        ("b_flood", scenario.QUIET_B, True, scenario.WHOLE),
    ]:
        patch_service(spread, seed)
        quiet = Seeded("quiet", rate)
        tenants = [quiet, Seeded("flood", scenario.FLOOD * rate)] if flood else [quiet]
        await scenario.Run(engine, tenants, fair=True).run()
        out[name] = scenario.p95(quiet.waits)
        if flood:
            served = sum(1 for w in tenants[1].waits if w != math.inf)
            span = scenario.SECONDS - scenario.MAX_WAIT_S - scenario.WARMUP_S
            out[name + "_flooder"] = served / span
            out[name + "_failed"] = quiet.failed
    return out


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--spread", default="0,0.5", help="service-time spreads, comma-separated")
    args = p.parse_args()
    remember_needs()
    for spread in [float(s) for s in args.spread.split(",")]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for label, rule in (("today", TODAY), ("burst claim", burst_claim)):
                f = await one(rule, seed, spread)
                bound = 1.2 * f["a_alone"] + 0.3 * scenario.SERVICE_S
                print(
                    f"spread {spread:g} seed {seed} {label:11s}: "
                    f"(a) p95 {f['a_flood']:.3f} vs bound {bound:.3f} "
                    f"{'met' if f['a_flood'] <= bound else 'MISSED'}, flooder "
                    f"{f['a_flood_flooder']:.3f}/s | (b) p95 {f['b_flood']:.3f} vs partition "
                    f"{f['b_part']:.3f} {'met' if f['b_flood'] <= f['b_part'] else 'MISSED'}, "
                    f"failed {f['b_flood_failed']:.0f}, flooder {f['b_flood_flooder']:.3f}/s",
                    flush=True,
                )


if __name__ == "__main__":
    asyncio.run(main())
