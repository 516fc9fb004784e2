"""The machine's timing floor: p50 and p99 of one fixed piece of work, timed many times.

    .venv/bin/python benchmarks/bench_jitter.py [--steps 600] [--times 20000]

A p99 target for a decision of a few tens of µs is bounded below by this: on a shared VM the
same arithmetic loop has a p99 two or more times its p50 (docs/benchmarks.md, "Admission at
scale"). Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import time


def work(steps: int) -> int:
    total = 0
    for i in range(steps):
        total += i * i
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_jitter.py", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=600, help="loop steps per timed call")
    p.add_argument("--times", type=int, default=20000, help="timed calls")
    args = p.parse_args(argv)
    times = []
    for _ in range(args.times):
        t0 = time.perf_counter_ns()
        work(args.steps)
        times.append((time.perf_counter_ns() - t0) / 1000)
    times.sort()
    p50, p99 = times[len(times) // 2], times[int(0.99 * len(times))]
    print(f"p50 {p50:.1f} us, p99 {p99:.1f} us, p99/p50 {p99 / p50:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
