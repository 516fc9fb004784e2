"""The engine probe's cost of reading a vLLM `/metrics` page, the whole page through
prometheus_client's parser (what the probe did before) against `parse_page` (only the lines
it reads go to the parser), on the same page, in the same run.

    python benchmarks/bench_metrics_parse.py [--rounds 5] [--page tests/fixtures/vllm/...]

Prints CPU ms per page (process time, median of the rounds, 200 parses each) and the ratio.
Each round times both, in alternating order, so drift of a busy machine falls on both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gateway.engines.metrics import parse_page
from gateway.loadtest.cpu import loadavg, machine

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "tests" / "fixtures" / "vllm" / "metrics-cpu-0.32-saturated.txt"


def _whole(text: str) -> None:
    for family in text_string_to_metric_families(text):
        list(family.samples)


def _cpu_ms(fn: object, text: str, n: int) -> float:
    assert callable(fn)
    start = time.process_time()
    for _ in range(n):
        fn(text)
    return (time.process_time() - start) / n * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--parses", type=int, default=200)
    parser.add_argument("--page", type=Path, default=PAGE)
    args = parser.parse_args()
    text = args.page.read_text()
    print(f"machine {machine()}; load average {loadavg()}; pid {os.getpid()}")
    print(f"page {args.page.name}: {len(text.splitlines())} lines, {len(text)} bytes")
    whole: list[float] = []
    filtered: list[float] = []
    for r in range(args.rounds):
        pair = [(_whole, whole), (parse_page, filtered)]
        for fn, out in pair if r % 2 == 0 else reversed(pair):
            out.append(_cpu_ms(fn, text, args.parses))
    w, f = statistics.median(whole), statistics.median(filtered)
    print(f"whole page through prometheus_client: {w:.2f} ms CPU per page (rounds {whole})")
    print(f"parse_page (only the lines read):    {f:.2f} ms CPU per page (rounds {filtered})")
    print(f"ratio {w / f:.1f}x; load average {loadavg()}")


if __name__ == "__main__":
    main()
