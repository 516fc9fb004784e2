"""Speed and error of every token counter, against the exact count of the bundled tokenizer.

    python benchmarks/bench_tokens.py [--seconds 0.3] [--no-engine]

For prompts (short 200 chars, medium 4 KiB, long 64 KiB) and chats (2 short messages, 8 turns
of 4 KiB), of English prose (the Python LICENSE.txt) and of code (stdlib ``json`` package
modules; neither was in the tokenizer's training set), it prints each counter's median time per
count in µs and its signed error against ``hf:@tiny``, the exact count for the model that the
simulator and the tiny vLLM model serve. ``engine`` asks a ``/tokenize`` server (Starlette +
uvicorn + the bundled tokenizer, like the simulator's) running in a child process on
127.0.0.1, so its time is one loopback HTTP round trip plus the server's own tokenization.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from gateway.harness import free_port
from gateway.tokens import HfTokenizer, TokenCounter, bundled_tokenizer_path, make_counter
from gateway.tokens.chat import ChatInput

MODEL = "tiny"
SIZES = {"short": 200, "medium": 4 * 1024, "long": 64 * 1024}
SPECS = ["hf:@tiny", "tiktoken:cl100k_base", "estimate", "engine"]


def corpus() -> dict[str, str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prose = (stdlib / "LICENSE.txt").read_text(encoding="utf-8")
    code = "".join(
        (stdlib / "json" / name).read_text(encoding="utf-8")
        for name in ("decoder.py", "encoder.py", "scanner.py", "tool.py", "__init__.py")
    )
    return {"prose": prose, "code": code}


def sized(text: str, size: int) -> str:
    repeated = text * (size // len(text) + 1)
    return repeated[:size]


def cases() -> list[tuple[str, str, Any]]:
    """(name, kind, input): kind is "prompt" (a str) or "chat" (a message list)."""
    out: list[tuple[str, str, Any]] = []
    for flavour, text in corpus().items():
        for size_name, size in SIZES.items():
            out.append((f"{flavour} {size_name} prompt", "prompt", sized(text, size)))
        short_chat = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": sized(text, SIZES["short"])},
        ]
        long_chat = [{"role": "system", "content": "You are a helpful assistant."}] + [
            {
                "role": "user" if i % 2 == 0 else "assistant",
                "content": sized(text[i * 997 :] or text, SIZES["medium"]),
            }
            for i in range(8)
        ]
        out.append((f"{flavour} 2-message chat", "chat", short_chat))
        out.append((f"{flavour} 8x4KiB chat", "chat", long_chat))
    return out


async def timed(call: Callable[[], Awaitable[int]], seconds: float) -> tuple[int, float]:
    """(count, median µs per call) over at least 5 calls and about ``seconds``."""
    count = await call()  # warm-up: caches, connection pool
    samples: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(samples) < 5 or time.perf_counter() < deadline:
        start = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - start) * 1e6)
    return count, statistics.median(samples)


def counter_call(counter: TokenCounter, kind: str, value: Any) -> Callable[[], Awaitable[int]]:
    async def prompt() -> int:
        return (await counter.count_prompt(value)).count

    async def chat() -> int:
        return (await counter.count_chat(ChatInput(value))).count

    return prompt if kind == "prompt" else chat


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{model}, nproc {os.cpu_count()}, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}, load average {os.getloadavg()[0]:.2f}"
    )


# --- the /tokenize server for the engine counter (child process) ---------------------------


def serve_tokenize(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    tok = HfTokenizer.load(bundled_tokenizer_path())

    async def tokenize(request: Request) -> JSONResponse:
        body = await request.json()
        if "messages" in body:
            ids = tok.encode(
                tok.apply_chat_template(body["messages"], body.get("add_generation_prompt", True)),
                add_special_tokens=False,
            )
        else:
            ids = tok.encode(body["prompt"])
        return JSONResponse({"count": len(ids), "max_model_len": 4096, "tokens": ids})

    app = Starlette(routes=[Route("/tokenize", tokenize, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


async def wait_ready(client: aiohttp.ClientSession, url: str) -> None:
    for _ in range(200):
        try:
            async with client.post(url + "/tokenize", json={"model": MODEL, "prompt": "x"}):
                return
        except aiohttp.ClientError:
            await asyncio.sleep(0.05)
    raise SystemExit(f"tokenize server at {url} did not start")


async def run(seconds: float, engine_url: str | None) -> None:
    exact = make_counter("hf:@tiny", model=MODEL)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30.0)) as client:
        specs = SPECS
        if engine_url is None:
            specs = [s for s in SPECS if s != "engine"]
        else:
            await wait_ready(client, engine_url)
        url = engine_url or ""
        counters = [
            make_counter(spec, model=MODEL, tokenize_urls=lambda: [url], client=client)
            for spec in specs
        ]
        print(f"machine: {machine()}")
        print(
            f"{'case':<26} {'counter':<22} {'µs/count':>10} {'tokens':>7} {'exact':>7} {'error':>8}"
        )
        for name, kind, value in cases():
            truth = await counter_call(exact, kind, value)()
            for counter in counters:
                count, micros = await timed(counter_call(counter, kind, value), seconds)
                error = (count - truth) / truth * 100
                print(
                    f"{name:<26} {counter.name:<22} {micros:>10.1f} {count:>7} {truth:>7} "
                    f"{error:>+7.1f}%"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description="token counter speed and error")
    parser.add_argument("--seconds", type=float, default=0.3, help="time per measurement")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine counter")
    parser.add_argument("--serve-tokenize", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_tokenize:
        serve_tokenize(args.serve_tokenize)
        return
    if args.no_engine:
        asyncio.run(run(args.seconds, None))
        return
    port = free_port()
    child = subprocess.Popen([sys.executable, __file__, "--serve-tokenize", str(port)])
    try:
        asyncio.run(run(args.seconds, f"http://127.0.0.1:{port}"))
    finally:
        child.terminate()
        child.wait(timeout=10)


if __name__ == "__main__":
    main()
