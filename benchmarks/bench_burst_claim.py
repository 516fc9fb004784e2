"""The burst claim (issue 18) on and off, in the fairness scenario on the simulated clock of
tests/state/test_fairness_scenario.py.

    .venv/bin/python benchmarks/bench_burst_claim.py [--seeds 0,1,2,3] [--spread 0,0.5]

The headroom rule (gateway/core/headroom.py) keeps free, for an admission that takes its
tenant above its share, what the other active tenants lack of their shares, and since issue
18's burst claim also what a holder near its share that usually stays well within it
claims for its next request (`burst_claim`); within-share admissions of tenants that are no
claimants themselves keep that claim free too. "off" runs the same store with the claims
taken as 0 (`ActiveTenants.claims` patched), which is the rule before the claim.

Prints, per seed and service-time spread (service times uniform in 1 ± spread service
times; 0: fixed, as the test), off against on: (a) the quiet tenant's p95 wait flooded
against its bound (1.2 x alone + 0.3 service times), (b) its p95 flooded against its static
partition's and its failed requests, and the flooder's requests served per second. Seed 0
is the test's streams. Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tests.state.test_fairness_scenario as scenario
from gateway.state import active

CLAIMS = active.ActiveTenants.claims


def no_claims(self: Any, *args: Any, **kwargs: Any) -> tuple[float, float]:
    return 0.0, 0.0


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


async def one(claims: Any, seed: int, spread: float) -> dict[str, float]:
    active.ActiveTenants.claims = claims  # type: ignore[method-assign]
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
    for spread in [float(s) for s in args.spread.split(",")]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for label, claims in (("off", no_claims), ("on", CLAIMS)):
                f = await one(claims, seed, spread)
                bound = 1.2 * f["a_alone"] + 0.3 * scenario.SERVICE_S
                print(
                    f"spread {spread:g} seed {seed} claims {label:3s}: "
                    f"(a) p95 {f['a_flood']:.3f} vs bound {bound:.3f} "
                    f"{'met' if f['a_flood'] <= bound else 'MISSED'}, flooder "
                    f"{f['a_flood_flooder']:.3f}/s | (b) p95 {f['b_flood']:.3f} vs partition "
                    f"{f['b_part']:.3f} {'met' if f['b_flood'] <= f['b_part'] else 'MISSED'}, "
                    f"failed {f['b_flood_failed']:.0f}, flooder {f['b_flood_flooder']:.3f}/s",
                    flush=True,
                )


if __name__ == "__main__":
    asyncio.run(main())
