"""What held the engine while the quiet tenant waited: a timeline from the gateways' access lines.

    .venv/bin/python benchmarks/fairness_timeline.py KEEP/a-flooded-access.json [--over 0.2]

Reads the access lines that `bench_fairness_live.py --breakdown --keep KEEP` keeps (every
tenant's, from every replica: `ts` when the answer ended, `duration_ms`, `wait_ms` from
arrival to the lease). A request held its lease from arrival + wait to its end (the log
line follows the release by microseconds). For every quiet request that waited longer
than `--over` seconds it prints the gap since the previous quiet arrival, how many
requests of each tenant held leases when it arrived, and every admission and end during its
wait: whether it waited for a tenant gone idle (the flooder holding everything), for its own
burst (the quiet tenant holding its share already), or for something else. Prints; asserts
nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Held:
    tenant: str
    arrived: float
    admitted: float | None  # None: never held a lease (refused, timed out)
    ended: float

    @property
    def wait(self) -> float:
        return (self.admitted if self.admitted is not None else self.ended) - self.arrived


def stamp(ts: str) -> float:
    parsed = datetime.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%fZ")
    return parsed.replace(tzinfo=datetime.UTC).timestamp()


def requests(lines: list[dict[str, object]]) -> list[Held]:
    out = []
    for r in lines:
        ended = stamp(str(r["ts"]))
        arrived = ended - float(r.get("duration_ms") or 0) / 1000  # type: ignore[arg-type]
        wait = float(r.get("wait_ms") or 0) / 1000  # type: ignore[arg-type]
        admitted = arrived + wait if r.get("blocks") else None
        out.append(Held(str(r["tenant"]), arrived, admitted, ended))
    t0 = min(h.arrived for h in out)
    return [
        Held(
            h.tenant,
            h.arrived - t0,
            None if h.admitted is None else h.admitted - t0,
            h.ended - t0,
        )
        for h in out
    ]


def holding(all_: list[Held], at: float, tenant: str) -> int:
    return sum(
        1
        for h in all_
        if h.tenant == tenant and h.admitted is not None and h.admitted <= at < h.ended
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fairness_timeline.py", description=__doc__.splitlines()[0])
    p.add_argument("access", type=Path)
    p.add_argument("--over", type=float, default=0.2, help="list the quiet waits above this (s)")
    args = p.parse_args(argv)
    all_ = requests(json.loads(args.access.read_text()))
    quiet = sorted((h for h in all_ if h.tenant == "quiet"), key=lambda h: h.arrived)
    tenants = sorted({h.tenant for h in all_})
    previous: Held | None = None
    for q in quiet:
        if q.wait > args.over and q.admitted is not None:
            gap = f"{q.arrived - previous.arrived:6.2f} s" if previous else "  first"
            held = ", ".join(f"{t} {holding(all_, q.arrived - 1e-4, t)}" for t in tenants)
            print(f"quiet at {q.arrived:7.2f} s waited {q.wait:.3f} s; gap {gap}; holding: {held}")
            events = []
            for h in all_:
                if h is q:
                    continue
                if h.admitted is not None and q.arrived <= h.admitted <= q.admitted + 0.01:
                    events.append((h.admitted, "admitted", h.tenant))
                if h.admitted is not None and q.arrived <= h.ended <= q.admitted + 0.01:
                    events.append((h.ended, "ended", h.tenant))
            for when, what, tenant in sorted(events):
                print(f"    {when - q.arrived:+.3f} s  {tenant} {what}")
        previous = q
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
