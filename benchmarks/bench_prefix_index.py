"""The gateway's prefix index (`gateway.core.prefix.PrefixIndex`): memory per entry and the
cost of `record` and `cached`, then what a large deployment needs (issue 15; not in CI).

    python benchmarks/bench_prefix_index.py [--entries 200000] [--prompt-blocks 100]
    python benchmarks/bench_prefix_index.py --scale --engines 100 --blocks 100000

Memory: `tracemalloc` counts what the index allocates while it is filled with `--entries`
distinct 8-byte hashes (`block_hashes`' digests) spread over `--engines` engines, as prompts
of `--prompt-blocks` blocks; bytes per entry is that over the entries. The hashes themselves
are counted too (the index keeps them alive), their list is not.

Time: `block_hashes` of one prompt's token ids (what the gateway computes per request),
`record` of one prompt (all its blocks new, then all already known: the LRU move), and
`cached` of a prompt whose blocks are all held and of one whose first block is unknown, in
µs per call and per block (median of `--repeat` timings of `--calls` calls each).

`--scale`: fill an index sized `--engines` × `--blocks` (each engine at its capacity: vLLM
cannot cache more than it has blocks), print its memory and the time of the calls at that
size, and what `prefix_cache.index_entries` it takes.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import time
import tracemalloc
from collections.abc import Callable

from gateway.core.prefix import DIGEST_BYTES, PrefixIndex, block_hashes

BLOCK_SIZE = 16


def prompts(count: int, blocks: int, seed: int) -> list[list[bytes]]:
    """`count` prompts of `blocks` full blocks each, no block shared between two prompts."""
    out = []
    for n in range(count):
        ids = [seed * 1_000_003 + n * 7919 + i for i in range(blocks * BLOCK_SIZE)]
        out.append(block_hashes(ids, BLOCK_SIZE, extra=b"bench"))
    return out


def fill(index: PrefixIndex, engines: int, entries: int, prompt_blocks: int) -> int:
    """Record prompts round robin over the engines until `entries` hashes are held."""
    made = 0
    n = 0
    while made < entries:
        take = min(prompt_blocks, entries - made)
        (hashes,) = prompts(1, take, seed=n)
        index.record(f"e{n % engines}", hashes)
        made += take
        n += 1
    return made


def measure_memory(
    engines: int, entries: int, prompt_blocks: int, capacity: int
) -> tuple[PrefixIndex, int]:
    """The index filled with `entries` hashes, and the bytes it holds (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(max_entries=entries)
    for e in range(engines):
        index.set_capacity(f"e{e}", capacity)
    fill(index, engines, entries, prompt_blocks)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(index) == entries, (len(index), entries)
    return index, after - before


def timed(fn: Callable[[], object], calls: int, repeat: int) -> float:
    """Median seconds per call."""
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls)
    return statistics.median(runs)


def call_costs(
    index: PrefixIndex, engine: str, prompt_blocks: int, calls: int, repeat: int
) -> dict[str, float]:
    """µs per call of record (new blocks, known blocks) and cached (all hit, first miss)."""
    fresh = iter(prompts(calls * repeat, prompt_blocks, seed=987_654))
    known = prompts(1, prompt_blocks, seed=123_456)[0]
    index.record(engine, known)
    miss = prompts(1, prompt_blocks, seed=555_555)[0]
    ids = list(range(prompt_blocks * BLOCK_SIZE))
    return {
        "block_hashes": timed(lambda: block_hashes(ids, BLOCK_SIZE, b"m"), calls, repeat) * 1e6,
        "record_new": timed(lambda: index.record(engine, next(fresh)), calls, repeat) * 1e6,
        "record_known": timed(lambda: index.record(engine, known), calls, repeat) * 1e6,
        "cached_hit": timed(lambda: index.cached(engine, known), calls, repeat) * 1e6,
        "cached_miss": timed(lambda: index.cached(engine, miss), calls, repeat) * 1e6,
    }


def print_costs(costs: dict[str, float], prompt_blocks: int) -> None:
    for name, us in costs.items():
        per_block = "" if name == "cached_miss" else f"  ({us / prompt_blocks:.3f} µs per block)"
        print(f"  {name:<13} {us:9.1f} µs per call of {prompt_blocks} blocks{per_block}")


def machine() -> str:
    load = os.getloadavg()
    return (
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=200_000)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--prompt-blocks", type=int, default=100)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--scale", action="store_true", help="engines × blocks, at capacity")
    parser.add_argument("--blocks", type=int, default=100_000, help="--scale: blocks per engine")
    args = parser.parse_args()
    print(machine())
    if args.scale:
        scale(args)
        return
    index, used = measure_memory(args.engines, args.entries, args.prompt_blocks, args.entries)
    entries = len(index)
    print(
        f"memory: {entries:,} entries over {args.engines} engines: {used / 2**20:,.1f} MiB, "
        f"{used / entries:.1f} bytes per entry ({DIGEST_BYTES}-byte hashes)"
    )
    index.max_entries = entries * 2  # room: the timed records add entries
    print(f"time, index of {len(index):,} entries:")
    print_costs(
        call_costs(index, "e0", args.prompt_blocks, args.calls, args.repeat), args.prompt_blocks
    )


def scale(args: argparse.Namespace) -> None:
    total = args.engines * args.blocks
    if args.blocks % args.prompt_blocks:
        raise SystemExit("--blocks must be a multiple of --prompt-blocks (engines fill evenly)")
    t0 = time.perf_counter()
    index, used = measure_memory(args.engines, total, args.prompt_blocks, args.blocks)
    entries = len(index)
    filled_s = time.perf_counter() - t0
    print(
        f"scale: {args.engines} engines × {args.blocks:,} blocks = {entries:,} entries: "
        f"{used / 2**30:.2f} GiB ({used / entries:.1f} bytes per entry), filled in "
        f"{filled_s:.0f} s under tracemalloc"
    )
    print(
        f"  prefix_cache.index_entries for every block of every engine: {total:,} "
        f"(default 1,000,000 covers {1_000_000 // args.blocks} such engines)"
    )
    print(f"time, full index of {len(index):,} entries (the oldest evicted by each record):")
    print_costs(
        call_costs(index, "e0", args.prompt_blocks, args.calls, args.repeat), args.prompt_blocks
    )


if __name__ == "__main__":
    main()
