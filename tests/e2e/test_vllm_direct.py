"""The real engine on its own: what the gateway relies on, and the overload it exists to prevent."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.engine import Engine, EngineLimits
from gateway.sim.metrics import EngineMetrics
from tests.e2e import conftest
from tests.e2e.engine_metrics import SAMPLING_PATH, scrape
from tests.e2e.overload import PROMPT, run_overload

pytestmark = pytest.mark.vllm

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three prime numbers."},
]


@pytest.fixture
def client(vllm_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{vllm_url}/v1", api_key="e2e", max_retries=0) as c:
        yield c


def tokenize(engine_url: str, body: dict[str, object]) -> int:
    response = httpx.post(f"{engine_url}/tokenize", json={"model": "tiny", **body}, timeout=30)
    response.raise_for_status()
    count: int = response.json()["count"]
    assert count == len(response.json()["tokens"])
    return count


def test_discovery_facts(vllm_url: str) -> None:
    models = httpx.get(f"{vllm_url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == conftest.MAX_MODEL_LEN
    metrics = scrape(vllm_url)
    assert metrics.num_gpu_blocks == conftest.NUM_GPU_BLOCKS
    assert metrics.block_size == conftest.BLOCK_SIZE
    # The watchers' path serves the same registry (idle engine: the same values).
    assert scrape(vllm_url, path=SAMPLING_PATH) == metrics


def _histograms(page: str) -> dict[str, tuple[str, frozenset[str], tuple[str, ...]]]:
    """histogram name -> (help text, label names, bucket bounds)."""
    return {
        f.name: (
            f.documentation,
            frozenset(k for s in f.samples for k in s.labels),
            tuple(s.labels["le"] for s in f.samples if s.name.endswith("_bucket")),
        )
        for f in text_string_to_metric_families(page)
        if f.type == "histogram"
    }


def test_publishes_every_histogram_the_simulator_imitates(vllm_url: str) -> None:
    """The simulator's latency and size histograms (issue 40) are vLLM's: same names, help
    texts, labels and buckets (the token buckets follow max_model_len)."""
    limits = EngineLimits(
        num_gpu_blocks=conftest.NUM_GPU_BLOCKS,
        block_size=conftest.BLOCK_SIZE,
        max_model_len=conftest.MAX_MODEL_LEN,
    )
    sim = EngineMetrics(
        model_name="tiny", limits=limits, snapshot=Engine(limits).snapshot, started_at=0.0
    )
    ours = _histograms(sim.render().decode())
    real = _histograms(httpx.get(f"{vllm_url}/metrics", timeout=30).text)
    assert "vllm:inter_token_latency_seconds" in ours
    for name, shape in ours.items():
        assert real.get(name) == shape, name


def test_chat(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8)
    assert reply.model == "tiny"
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage is not None and reply.usage.completion_tokens <= 8


def test_chat_streaming(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 8
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_completion(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 16


def test_completion_streaming(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


def test_tokenize_counts_match_usage(vllm_url: str, client: openai.OpenAI) -> None:
    prompt_count = tokenize(vllm_url, {"prompt": PROMPT})
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1)
    assert reply.usage is not None and reply.usage.prompt_tokens == prompt_count
    # The overload's prompt is about 20 tokens, as in the run recorded in REAL-VLLM.md, so that
    # prompt + 200 output tokens ends in the second 128-token block.
    assert 10 <= prompt_count <= 30

    chat_count = tokenize(vllm_url, {"messages": MESSAGES, "add_generation_prompt": True})
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    assert chat.usage is not None and chat.usage.prompt_tokens == chat_count
    assert chat_count > tokenize(vllm_url, {"prompt": MESSAGES[1]["content"]})


async def test_overload_direct_preempts(vllm_url: str) -> None:
    """20 x (20 + 200) tokens need 40 blocks at the end; the engine has 6 and preempts."""
    outcome = await run_overload(vllm_url, vllm_url, requests=20, max_tokens=200)
    conftest.record_figure("overload direct", outcome.summary())
    assert outcome.outcomes == {"completed": 20}, outcome.summary()
    assert outcome.preemptions > 0, outcome.summary()
