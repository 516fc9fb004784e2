"""Every counter against the same contract, then each counter's own arithmetic."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.tokens import (
    OFFLOAD_CHARS,
    ChatTemplateError,
    HfTokenizer,
    TokenCounter,
    bundled_tokenizer_path,
    make_counter,
)
from gateway.tokens.chat import ChatInput
from gateway.tokens.protocol import count_off_loop
from gateway.tokens.tiktoken_local import load_encoding
from tests.tokens.conftest import MODEL, TokenizeServer

SPECS = ["hf:@tiny", "tiktoken:cl100k_base", "estimate", "estimate:3", "engine"]

CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is a KV cache?", "name": "ada"},
]


@pytest.fixture(params=SPECS)
async def counter(
    request: pytest.FixtureRequest, engine_a: TokenizeServer, client: aiohttp.ClientSession
) -> AsyncIterator[TokenCounter]:
    spec: str = request.param
    yield make_counter(spec, model=MODEL, tokenize_urls=lambda: [engine_a.url], client=client)


# --- conformance: every counter -----------------------------------------------------------


async def test_is_a_token_counter(counter: TokenCounter) -> None:
    assert isinstance(counter, TokenCounter)
    assert counter.name


async def test_prompt_counts_are_sane(counter: TokenCounter) -> None:
    assert (await counter.count_prompt("")).count == 0
    short = (await counter.count_prompt("hello world")).count
    longer = (await counter.count_prompt("hello world " * 50)).count
    assert 0 < short < longer


async def test_chat_counts_template_overhead(counter: TokenCounter) -> None:
    text_only = sum([(await counter.count_prompt(m["content"])).count for m in CHAT])
    with_priming = (await counter.count_chat(ChatInput(CHAT))).count
    without = (await counter.count_chat(ChatInput(CHAT, add_generation_prompt=False))).count
    assert text_only < without < with_priming
    assert (await counter.count_chat(ChatInput([], add_generation_prompt=False))).count == 0


async def test_large_inputs_count_the_same(counter: TokenCounter) -> None:
    # Above OFFLOAD_CHARS the local counters run in a worker thread; the answer is the same.
    unit = "The quick brown fox jumps over the lazy dog. "
    reps = OFFLOAD_CHARS // len(unit) + 10
    small = (await counter.count_prompt(unit * 10)).count
    large = (await counter.count_prompt(unit * reps)).count
    assert large > small
    big_chat = [{"role": "user", "content": unit * reps}]
    assert (await counter.count_chat(ChatInput(big_chat))).count > large


@pytest.mark.parametrize("spec", [s for s in SPECS if s != "engine"])
async def test_uncountable_content_is_a_value_error(spec: str) -> None:
    # Local counters count media parts only as the service counted them (ChatInput.media):
    # never as zero. For `engine` the engine decides (see test_engine_counter).
    counter = make_counter(spec, model=MODEL)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ChatTemplateError, match=r"1 media part\(s\) but 0 counted"):
        await counter.count_chat(ChatInput(image))
    unknown = [{"role": "user", "content": [{"type": "hologram", "hologram": "x"}]}]
    with pytest.raises(ChatTemplateError, match=r"messages\[0\].*'hologram'"):
        await counter.count_chat(ChatInput(unknown))
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        await counter.count_chat(ChatInput([{"role": "user", "content": "x"}, "not a message"]))  # type: ignore[list-item]


# --- each counter's own arithmetic --------------------------------------------------------


async def test_hf_counts_are_encode_lengths(tiny: HfTokenizer) -> None:
    counter = make_counter("hf:@tiny", model=MODEL)
    for text in ["", "a", "héllo wörld", "import os\nprint(os.getcwd())\n", "x" * 40_000]:
        assert (await counter.count_prompt(text)).count == len(tiny.encode(text))
    rendered = tiny.apply_chat_template(CHAT)
    assert (await counter.count_chat(ChatInput(CHAT))).count == len(
        tiny.encode(rendered, add_special_tokens=False)
    )


_TINY = HfTokenizer.load(bundled_tokenizer_path())


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_hf_encoding_is_lossless_and_counted_by_length(text: str) -> None:
    ids = _TINY.encode(text)
    assert _TINY.decode(ids) == text
    assert _TINY.count(text) == len(ids)


async def test_tiktoken_chat_follows_openai_recipe() -> None:
    counter = make_counter("tiktoken:cl100k_base", model=MODEL)
    enc = load_encoding("cl100k_base")
    expected = 3  # reply priming
    for message in CHAT:
        expected += 3 + sum(len(enc.encode_ordinary(v)) for v in message.values())
    expected += 1  # one message has a name
    assert (await counter.count_chat(ChatInput(CHAT))).count == expected
    assert (
        await counter.count_chat(ChatInput(CHAT, add_generation_prompt=False))
    ).count == expected - 3


async def test_tiktoken_treats_special_token_text_as_text() -> None:
    counter = make_counter("tiktoken:cl100k_base", model=MODEL)
    assert (await counter.count_prompt("<|endoftext|>")).count > 1


@pytest.mark.parametrize(
    ("spec", "text", "expected"),
    [
        ("estimate", "", 0),
        ("estimate", "abcd", 1),
        ("estimate", "abcde", 2),
        ("estimate", "é" * 4, 2),  # 8 UTF-8 bytes
        ("estimate:2", "abcde", 3),
        ("estimate:3.5", "a" * 7, 2),
    ],
)
async def test_estimate_is_bytes_over_ratio_rounded_up(spec: str, text: str, expected: int) -> None:
    assert (await make_counter(spec, model=MODEL).count_prompt(text)).count == expected


async def test_estimate_chat_overhead() -> None:
    counter = make_counter("estimate", model=MODEL)
    messages = [{"role": "user", "content": "abcdefgh"}]  # 2 + role 1 + markers 4
    assert (await counter.count_chat(ChatInput(messages, add_generation_prompt=False))).count == 7
    assert (await counter.count_chat(ChatInput(messages))).count == 10


async def test_count_off_loop_uses_a_thread_only_for_large_inputs() -> None:
    seen: list[int] = []

    def count() -> int:
        seen.append(threading.get_ident())
        return 7

    assert await count_off_loop(count, OFFLOAD_CHARS) == 7
    assert await count_off_loop(count, OFFLOAD_CHARS + 1) == 7
    assert seen[0] == threading.get_ident() != seen[1]
