"""The ledger checked against the real engine (issue 37): a randomized mix through the gateway in
`worst_case`, once with the engine's prefix caching on and once with
`--no-enable-prefix-caching`, while vLLM's `/metrics/` and the gateway's `/admin/status` are
sampled side by side (tests/e2e/ledger_watch.py).

The mix: identical prompts in bursts, a shared system prompt with distinct tails, `cache_salt`,
`n` up to 4, chats with tools, streams cancelled mid-way, `max_tokens` loose (a stop string
ends the answer early) and over-long (clamped to what the context leaves). Asserted in both
runs: no preemption; vLLM's running + waiting never above `max_num_seqs` + the staged
sequences; vLLM's used blocks never above the gateway's reserved blocks around the same moment
(`ledger_watch.brackets`) nor above the capacity the gateway plans with; with caching on, some
answers credited (a gateway that never credits fails), with it off none.

Each run has its own engine of `NUM_GPU_BLOCKS` blocks (started here and stopped at the end of
the run, so the 2 cores and the memory are free for the rest). The seed is printed and recorded
(`KVGW_E2E_SEED` overrides it); the slack per shape (the gateway's reservation against the
blocks vLLM held) is recorded as a figure for docs/benchmarks.md.

`KVGW_E2E_CLAIM_PREFIX_CACHING=1` configures `engines[].prefix_caching: true` whatever the
engine says: the caching-off run then credits where vLLM shares nothing, and must fail (the
check that the assertions can fail).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.core.footprint import ceil_div
from gateway.tokens import make_counter
from tests.e2e import conftest
from tests.e2e.engine_metrics import scrape
from tests.e2e.gateway_process import (
    TOKENIZER_DIR,
    GatewayProcess,
    gateway_config,
    serving_gateway,
)
from tests.e2e.ledger_watch import LedgerWatch, Sample, brackets

pytestmark = pytest.mark.vllm

SEED = int(os.environ.get("KVGW_E2E_SEED", "3737"))
CLAIM_CACHING = os.environ.get("KVGW_E2E_CLAIM_PREFIX_CACHING", "") == "1"
NUM_GPU_BLOCKS = 12  # 11 usable: a 4-block request and a burst beside it
BLOCK = conftest.BLOCK_SIZE
EVENTS = 40  # each shape twice, the rest drawn at random; an event sends 1-4 requests
ARRIVALS_S = 0.5  # the most between two events' starts

UNIT = "for block in cache: block.ref_cnt += 1\n"
SYSTEM_UNIT = "You answer in one line and cite the block pool. "
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
PING = {"type": "function", "function": {"name": "ping"}}
TOOL_HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


@dataclass(frozen=True)
class Answer:
    """One request's outcome: what the gateway reserved and what vLLM held for it."""

    shape: str
    status: str  # "ok", "cancelled" or the error
    blocks: int  # x-kv-gateway-blocks: the credited reservation
    credit: int  # x-kv-gateway-prefix-credit
    held: int  # the blocks vLLM allocated for its sequences (below), before any sharing


def held_blocks(prompt: int, completion: int, n: int) -> int:
    """vLLM's allocation for `n` sequences that each computed `prompt + completion - 1` tokens
    (the last sampled token is never computed), counting each copy of the prompt."""
    return n * ceil_div(prompt + max(completion - 1, 0), BLOCK)


@dataclass(frozen=True)
class Prompts:
    shared: str  # 2 full blocks and a part: bursts, salts, cancelled streams
    system: str  # a system prompt of 2 full blocks and more once rendered
    n_prompt: str  # 1 full block and a part: for n up to 4 (2 blocks each)
    long_tail: str  # ~300 tokens, distinct per request by a header: clamped
    short_tail: str  # ~60 tokens, distinct per request: loose


async def _prompts() -> Prompts:
    counter = make_counter(f"hf:{TOKENIZER_DIR}", model="tiny")

    async def sized(unit: str, lo: int, hi: int) -> str:
        for repeat in range(1, 300):
            if lo <= (await counter.count_prompt(unit * repeat)).count <= hi:
                return unit * repeat
        raise AssertionError(f"no repetition of {unit!r} has {lo}..{hi} tokens")

    return Prompts(
        shared=await sized(UNIT, 2 * BLOCK + 10, 2 * BLOCK + 40),
        system=await sized(SYSTEM_UNIT, 2 * BLOCK + 10, 2 * BLOCK + 40),
        n_prompt=await sized(UNIT, BLOCK + 5, BLOCK + 20),
        long_tail=await sized(UNIT, 2 * BLOCK + 30, 2 * BLOCK + 50),
        short_tail=await sized(UNIT, 50, 60),
    )


class Mix:
    """The shapes, each an event that sends one or more requests at once; `rng` decides their
    sizes, so a seed replays the same mix."""

    def __init__(self, client: openai.AsyncOpenAI, prompts: Prompts, rng: random.Random) -> None:
        self.client = client
        self.prompts = prompts
        self.rng = rng
        self.count = 0
        self.shapes: dict[str, Callable[[], list[Awaitable[Answer]]]] = {
            "burst of identical prompts": self.burst,
            "shared system prompt, distinct tails": self.system,
            "cache_salt": self.salted,
            "n = 2..4": self.n_choices,
            "chat with tools": self.tools,
            "stream cancelled mid-way": self.cancelled,
            "max_tokens over-long (clamped)": self.clamped,
            "max_tokens loose (stop string)": self.loose,
        }

    def _unique(self) -> str:
        self.count += 1
        return f"# request {self.count}\n"

    def burst(self) -> list[Awaitable[Answer]]:
        out = self.rng.randint(20, 100)
        return [
            self._completion("burst of identical prompts", self.prompts.shared, out)
            for _ in range(self.rng.randint(2, 4))
        ]

    def system(self) -> list[Awaitable[Answer]]:
        return [
            self._chat(
                "shared system prompt, distinct tails",
                [
                    {"role": "system", "content": self.prompts.system},
                    {"role": "user", "content": f"{self._unique()} which block is free?"},
                ],
                self.rng.randint(20, 80),
            )
            for _ in range(self.rng.randint(1, 3))
        ]

    def salted(self) -> list[Awaitable[Answer]]:
        return [
            self._completion(
                "cache_salt",
                self.prompts.shared,
                self.rng.randint(20, 100),
                cache_salt=self.rng.choice(["tenant-a", "tenant-b"]),
            )
            for _ in range(self.rng.randint(2, 3))
        ]

    def n_choices(self) -> list[Awaitable[Answer]]:
        n = self.rng.randint(2, 4)
        return [self._completion("n = 2..4", self.prompts.n_prompt, self.rng.randint(30, 100), n=n)]

    def tools(self) -> list[Awaitable[Answer]]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, *TOOL_HISTORY]
        if self.rng.random() < 0.5:
            messages.append({"role": "user", "content": f"{self._unique()} and in Rome?"})
        return [
            self._chat(
                "chat with tools",
                messages,
                self.rng.randint(20, 60),
                tools=[WEATHER, PING],
                tool_choice="none",
            )
        ]

    def cancelled(self) -> list[Awaitable[Answer]]:
        return [self._cancelled(self.rng.randint(3, 60))]

    def clamped(self) -> list[Awaitable[Answer]]:
        prompt = self._unique() + self.prompts.long_tail
        return [
            self._completion("max_tokens over-long (clamped)", prompt, conftest.MAX_MODEL_LEN - 30)
        ]

    def loose(self) -> list[Awaitable[Answer]]:
        prompt = self._unique() + self.prompts.short_tail
        # Sampled (seeded) rather than greedy: random text meets a newline within a few tokens.
        return [
            self._completion(
                "max_tokens loose (stop string)",
                prompt,
                self.rng.randint(200, 400),
                ignore_eos=False,
                temperature=1.0,
                stop=["\n"],
                seed=self.rng.randrange(1 << 30),
            )
        ]

    async def _completion(
        self,
        shape: str,
        prompt: str,
        max_tokens: int,
        *,
        n: int = 1,
        ignore_eos: bool = True,
        cache_salt: str | None = None,
        **options: Any,
    ) -> Answer:
        extra: dict[str, Any] = {"ignore_eos": ignore_eos}
        if cache_salt is not None:
            extra["cache_salt"] = cache_salt
        try:
            raw = await self.client.completions.with_raw_response.create(
                model="tiny", prompt=prompt, max_tokens=max_tokens, n=n, extra_body=extra, **options
            )
        except openai.APIError as exc:
            return Answer(shape, repr(exc), 0, 0, 0)
        usage = raw.parse().usage
        assert usage is not None
        return _answer(shape, raw.headers, usage.prompt_tokens, usage.completion_tokens, n)

    async def _chat(
        self, shape: str, messages: list[dict[str, Any]], max_tokens: int, **options: Any
    ) -> Answer:
        try:
            raw = await self.client.chat.completions.with_raw_response.create(
                model="tiny",
                messages=messages,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                extra_body={"ignore_eos": True},
                **options,
            )
        except openai.APIError as exc:
            return Answer(shape, repr(exc), 0, 0, 0)
        usage = raw.parse().usage
        assert usage is not None
        return _answer(shape, raw.headers, usage.prompt_tokens, usage.completion_tokens, 1)

    async def _cancelled(self, after: int) -> Answer:
        """A stream of the shared prompt closed after `after` chunks (one token each)."""
        shape = "stream cancelled mid-way"
        try:
            async with self.client.completions.with_streaming_response.create(
                model="tiny",
                prompt=self.prompts.shared,
                max_tokens=220,
                stream=True,
                extra_body={"ignore_eos": True},
            ) as stream:
                chunks = 0
                async for line in stream.iter_lines():
                    chunks += line.startswith("data: {")
                    if chunks >= after:
                        break
                headers = stream.headers
        except openai.APIError as exc:
            return Answer(shape, repr(exc), 0, 0, 0)
        prompt = int(headers["x-kv-gateway-prompt-tokens"])
        answer = _answer(shape, headers, prompt, chunks, 1)
        return Answer(shape, "cancelled", answer.blocks, answer.credit, answer.held)


def _answer(shape: str, headers: Any, prompt: int, completion: int, n: int) -> Answer:
    return Answer(
        shape,
        "ok",
        int(headers["x-kv-gateway-blocks"]),
        int(headers.get("x-kv-gateway-prefix-credit", 0)),
        held_blocks(prompt, completion // n, n),
    )


async def _drive(mix: Mix, rng: random.Random) -> list[Answer]:
    """EVENTS events, each shape at least twice, started at random gaps; every answer."""
    names = list(mix.shapes) * 2
    names += [rng.choice(list(mix.shapes)) for _ in range(EVENTS - len(names))]
    rng.shuffle(names)

    async def event(delay: float, requests: list[Awaitable[Answer]]) -> list[Answer]:
        await asyncio.sleep(delay)
        return list(await asyncio.gather(*requests))

    # Every request's size and every gap is drawn before anything is sent: the seed alone
    # decides them, not the order in which answers come back.
    events = []
    delay = 0.0
    for name in names:
        events.append(event(delay, mix.shapes[name]()))
        delay += rng.uniform(0, ARRIVALS_S)
    batches = await asyncio.gather(*events)
    return [answer for batch in batches for answer in batch]


@dataclass(frozen=True)
class Run:
    answers: list[Answer]
    samples: list[Sample]
    preemptions: float
    seconds: float


async def _run(engine_url: str, gateway: GatewayProcess, rng: random.Random) -> Run:
    prompts = await _prompts()
    before = scrape(engine_url)
    started = time.monotonic()
    async with openai.AsyncOpenAI(
        base_url=f"{gateway.url}/v1", api_key="e2e", max_retries=0, timeout=120
    ) as client:
        with LedgerWatch(engine_url, gateway.url) as watch:
            answers = await _drive(Mix(client, prompts, rng), rng)
            # Until both sides are idle again (a cancelled stream ends in vLLM a little later).
            await _settles(engine_url, gateway)
    seconds = time.monotonic() - started
    await asyncio.sleep(0.5)  # the preemption counter follows the engine's step stats
    after = scrape(engine_url)
    return Run(
        answers, watch.samples, after.num_preemptions_total - before.num_preemptions_total, seconds
    )


async def _settles(engine_url: str, gateway: GatewayProcess, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        engine = scrape(engine_url)
        idle = (round(engine.used_blocks), engine.running + engine.waiting)
        reserved = gateway.status()["engines"][0]["reserved_blocks"]
        if idle == (0, 0) and reserved == 0:
            return
        assert time.monotonic() < deadline, f"not idle after the mix: {idle}, {reserved}"
        await asyncio.sleep(0.2)


def slack_table(answers: list[Answer]) -> list[str]:
    """Per shape: requests, credited, and per request (mean, max) the gateway's reservation
    (credited), the blocks vLLM allocated for it beyond those it shared with live requests
    (`held` less the credit), and the slack between the two."""
    by_shape: dict[str, list[Answer]] = defaultdict(list)
    for answer in answers:
        by_shape[answer.shape].append(answer)
    rows = []
    for shape, group in by_shape.items():
        reserved = [a.blocks for a in group]
        own = [a.held - a.credit for a in group]
        rows.append(
            f"{shape}: {len(group)} requests, {sum(a.credit > 0 for a in group)} credited; "
            f"reserved {sum(reserved) / len(group):.2f} (max {max(reserved)}), "
            f"vLLM held {sum(own) / len(group):.2f} (max {max(own)}), "
            f"slack {(sum(reserved) - sum(own)) / len(group):.2f}"
        )
    return rows


@pytest.mark.parametrize("caching", [True, False], ids=["caching-on", "caching-off"])
async def test_worst_case_ledger_holds_on_the_real_engine(
    caching: bool, vllm_model_dir: Path, tmp_path: Path
) -> None:
    setting = "on" if caching else "off"
    print(f"\nledger mix: seed {SEED} (KVGW_E2E_SEED), prefix caching {setting}")
    engine_args = [] if caching else ["--no-enable-prefix-caching"]
    spec: dict[str, Any] = {
        "num_gpu_blocks": NUM_GPU_BLOCKS,
        "block_size": BLOCK,
        "max_num_seqs": conftest.MAX_NUM_SEQS,
        "max_model_len": conftest.MAX_MODEL_LEN,
    }
    if CLAIM_CACHING:
        spec["prefix_caching"] = True
    with conftest.own_engine(
        vllm_model_dir,
        tmp_path,
        f"ledger mix engine, prefix caching {setting}",
        kv_cache_memory_bytes=NUM_GPU_BLOCKS * BLOCK * 1024,
        extra_args=engine_args,
    ) as engine_url:
        assert scrape(engine_url).num_gpu_blocks == NUM_GPU_BLOCKS
        config = gateway_config(engine_url, engine=spec)
        with serving_gateway(config, tmp_path) as gateway:
            status = gateway.status()["engines"][0]
            assert status["prefix_caching"] is (caching or CLAIM_CACHING), status
            capacity = status["capacity_blocks"]
            seq_bound = status["max_num_seqs"] + status["staged_seqs"]
            run = await _run(engine_url, gateway, random.Random(SEED))
    answers, samples = run.answers, run.samples
    table = slack_table(answers)
    _report(setting, run, table, capacity)

    context = f"seed {SEED}, prefix caching {setting}"
    assert {a.status for a in answers} <= {"ok", "cancelled"}, (context, answers)
    assert run.preemptions == 0, context
    assert samples, context
    over_seqs = [s for s in samples if s.running + s.waiting > seq_bound]
    assert not over_seqs, (context, seq_bound, over_seqs[:5])
    over_capacity = [s for s in samples if s.used > capacity]
    assert not over_capacity, (context, capacity, over_capacity[:5])
    over_ledger = [(s, r) for s, r in brackets(samples) if s.used > r]
    assert not over_ledger, (context, over_ledger[:5])
    credited = sum(a.credit > 0 for a in answers)
    if caching:
        assert credited, f"{context}: no answer was credited"
    else:
        assert credited == 0, context


def _report(setting: str, run: Run, table: list[str], capacity: int) -> None:
    """Print the run (seen with -s) and record it for the terminal summary."""
    busy = [(s, r) for s, r in brackets(run.samples) if s.used or r]
    peak_used = max((s.used for s, _ in busy), default=0)
    peak_reserved = max((r for _, r in busy), default=0)
    margin = min((r - s.used for s, r in busy), default=0)
    mean = sum(r - s.used for s, r in busy) / len(busy) if busy else 0.0
    summary = (
        f"seed {SEED}: {len(run.answers)} requests in {run.seconds:.1f} s, "
        f"preemptions {run.preemptions:g}; {len(run.samples)} samples ({len(busy)} busy): "
        f"vLLM used peak {peak_used}, gateway reserved peak {peak_reserved} of {capacity}, "
        f"reserved - used min {margin} mean {mean:.2f}; "
        f"running+waiting peak {max((s.running + s.waiting for s in run.samples), default=0)}"
    )
    print(f"prefix caching {setting}: {summary}")
    for row in table:
        print(f"  {row}")
    conftest.record_figure(f"ledger mix, prefix caching {setting}", summary)
    for row in table:
        conftest.record_figure(f"ledger mix, prefix caching {setting}, slack", row)
