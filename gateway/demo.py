"""`kv-gateway demo`: the whole product on a laptop — no GPU, no Redis, no config file.

Two simulated vLLM engines of different sizes and the gateway in front of them, in one
process, with in-process state. Stops cleanly on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
from typing import TYPE_CHECKING

from gateway.config import GatewayConfig, parse_config
from gateway.embedded import running_app
from gateway.http.app import create_app
from gateway.http.listener import protocol_for
from gateway.runtime import build_runtime
from gateway.serve import configure_logging

if TYPE_CHECKING:
    from gateway.sim.server import SimConfig

log = logging.getLogger("gateway.demo")

MODEL = "tiny"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address of the gateway")
    parser.add_argument("--port", type=int, default=8000, help="port of the gateway")
    parser.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"]
    )


def _sim_configs() -> list[SimConfig]:
    from gateway.sim.server import SimConfig  # the gateway needs the simulator only here

    # Two engines of unequal size, at a speed a person can watch (~50 tokens/s per stream).
    common = SimConfig(
        served_model_name=MODEL,
        block_size=16,
        max_model_len=2048,
        decode_ms_base=15.0,
        decode_ms_per_seq=0.5,
        prefill_ms_per_token=0.05,
    )
    return [
        dataclasses.replace(common, num_gpu_blocks=513, max_num_seqs=16, seed=1),
        dataclasses.replace(common, num_gpu_blocks=161, max_num_seqs=8, seed=2),
    ]


def demo_config(urls: list[str]) -> GatewayConfig:
    return parse_config(
        {
            "engines": [
                {"name": "big", "url": urls[0], "max_num_seqs": 16},
                {"name": "small", "url": urls[1], "max_num_seqs": 8},
            ],
            "models": [{"name": MODEL, "tokenizer": "hf:@tiny"}],
        }
    )


def banner(url: str, engines: list[str], cfg: GatewayConfig) -> str:
    """What runs, in the figures `/admin/status` shows (from the same settings)."""
    ceiling = cfg.admission.kv_ceiling
    lines = []
    for name, sim, engine_url in zip(("big", "small"), _sim_configs(), engines, strict=True):
        usable = sim.num_gpu_blocks - 1  # vLLM keeps one null block
        lines.append(
            f"  {name:<5} {engine_url}  {sim.num_gpu_blocks} KV blocks of {sim.block_size} "
            f"tokens ({usable} usable, {int(usable * ceiling)} admissible at kv_ceiling "
            f"{ceiling:g}), {sim.max_num_seqs} seqs"
        )
    engines_text = "\n".join(lines)
    return f"""
kv-gateway demo: the gateway is at {url}, in front of two simulated vLLM engines:
{engines_text}
  queue: at most {cfg.queue.max_length} waiting, each for at most {cfg.queue.max_wait_s:g} s

Try it:
  curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{MODEL}", "max_tokens": 32,
         "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  python - <<'PY'
  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="unused")
  for chunk in client.chat.completions.create(model="{MODEL}", stream=True, max_tokens=64,
          messages=[{{"role": "user", "content": "Tell me a story"}}]):
      print(chunk.choices[0].delta.content or "", end="", flush=True)
  PY

  curl -s {url}/admin/status      # engines, reserved KV blocks, queue
  A burst beyond capacity is queued; what waits longer than the queue allows is answered
  HTTP 429 with a Retry-After (try 100 parallel requests with max_tokens 1500).

Ctrl-C stops everything.
"""


async def run_demo(host: str, port: int) -> None:
    from gateway.sim.embedded import running_sim

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(running_sim(cfg)) for cfg in _sim_configs()]
        cfg = demo_config(engines)
        runtime = await build_runtime(cfg)
        url = await stack.enter_async_context(
            running_app(
                create_app(runtime),
                host=host,
                port=port,
                http=protocol_for(cfg.clients, runtime.metrics),
            )
        )
        print(banner(url, engines, cfg), flush=True)
        await stop.wait()
        print("\nstopping: draining requests, then the engines ...", flush=True)
    print("stopped.", flush=True)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    try:
        asyncio.run(run_demo(args.host, args.port))
    except OSError as e:
        print(f"kv-gateway demo: cannot listen on {args.host}:{args.port}: {e.strerror}")
        return 1
    return 0
