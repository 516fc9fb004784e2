"""The overload of the key result: N concurrent streaming completions against a 6-block engine.

The same load is sent either directly to vLLM or through the gateway; the engine's `/metrics` is
polled meanwhile so the outcome says how far the engine was pushed (running, waiting, KV usage)
and how many preemptions the load caused.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

import httpx
import openai

from tests.e2e.engine_metrics import SAMPLING_PATH, EngineMetrics, ascrape

# About 20 tokens with the project's tiny tokenizer (the tests check the count on the engine).
PROMPT = "import os\nimport sys\n\ndef main(argv):\n    return 0\n"


@dataclass(frozen=True)
class OverloadOutcome:
    outcomes: Counter[str]  # "completed", "429", or another status / error name
    before: EngineMetrics
    after: EngineMetrics
    peak_running: float
    peak_waiting: float
    peak_kv_usage: float
    samples: int

    @property
    def preemptions(self) -> float:
        return self.after.num_preemptions_total - self.before.num_preemptions_total

    def summary(self) -> str:
        return (
            f"outcomes={dict(self.outcomes)} preemptions={self.preemptions:g} "
            f"peak running={self.peak_running:g} waiting={self.peak_waiting:g} "
            f"kv usage={self.peak_kv_usage:.3f} ({self.samples} samples)"
        )


async def _one(client: openai.AsyncOpenAI, max_tokens: int) -> str:
    try:
        stream = await client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        completion_tokens = None
        async for chunk in stream:
            if chunk.usage is not None:
                completion_tokens = chunk.usage.completion_tokens
            # Buffered chunks do not suspend the loop; let the /metrics watcher run.
            await asyncio.sleep(0)
    except openai.RateLimitError:
        return "429"
    except openai.APIStatusError as exc:
        return str(exc.status_code)
    except openai.APIError as exc:
        return type(exc).__name__
    if completion_tokens != max_tokens:
        return f"short:{completion_tokens}"
    return "completed"


async def run_overload(
    base_url: str, engine_url: str, *, requests: int = 20, max_tokens: int = 200
) -> OverloadOutcome:
    """Send `requests` concurrent streaming completions to `base_url`, watch `engine_url`."""
    # A fresh connection per scrape: a kept-alive one can be closed by the engine's server as
    # the next scrape is sent ("Server disconnected without sending a response", seen in CI).
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=10.0, limits=limits) as http:
        before = await ascrape(engine_url, http)
        peaks = {"running": 0.0, "waiting": 0.0, "usage": 0.0, "samples": 0.0}
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                m = await ascrape(engine_url, http, path=SAMPLING_PATH)
                peaks["running"] = max(peaks["running"], m.running)
                peaks["waiting"] = max(peaks["waiting"], m.waiting)
                peaks["usage"] = max(peaks["usage"], m.kv_cache_usage_perc)
                peaks["samples"] += 1
                await asyncio.sleep(0.05)

        client = openai.AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key="e2e", max_retries=0, timeout=300.0
        )
        async with client:
            watcher = asyncio.create_task(watch())
            try:
                results = await asyncio.gather(*(_one(client, max_tokens) for _ in range(requests)))
            finally:
                done.set()
                await watcher
        # The counter is updated when the engine logs its step stats; let it settle.
        await asyncio.sleep(0.5)
        after = await ascrape(engine_url, http)
    return OverloadOutcome(
        outcomes=Counter(results),
        before=before,
        after=after,
        peak_running=peaks["running"],
        peak_waiting=peaks["waiting"],
        peak_kv_usage=peaks["usage"],
        samples=int(peaks["samples"]),
    )
