"""Prompts of exact lengths with the bundled tokenizer (the simulator's): counted the engine's
way, shared prefixes that the suffix cannot merge into, conversations that grow exactly."""

from __future__ import annotations

import random

import pytest

from gateway.loadtest.prompts import PromptBuilder, PromptError


@pytest.fixture(scope="module")
def builder() -> PromptBuilder:
    return PromptBuilder.from_spec("hf:@tiny")


def ids(builder: PromptBuilder, messages: list[dict[str, str]], gen: bool = True) -> list[int]:
    text = builder.tokenizer.apply_chat_template(messages, add_generation_prompt=gen)
    return builder.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("tokens", [12, 13, 100, 1000, 4000])
def test_chat_is_exact(builder: PromptBuilder, tokens: int) -> None:
    rng = random.Random(tokens)
    built = builder.chat(tokens, rng)
    assert built.prompt_tokens == tokens == builder.count_chat(built.messages or [])


@pytest.mark.parametrize("tokens", [1, 2, 50, 3000])
def test_completion_text_and_ids_are_exact(builder: PromptBuilder, tokens: int) -> None:
    rng = random.Random(tokens)
    text = builder.completion(tokens, rng)
    assert isinstance(text.prompt, str) and builder.count_completion(text.prompt) == tokens
    as_ids = builder.completion(tokens, rng, token_ids=True)
    assert isinstance(as_ids.prompt, list) and len(as_ids.prompt) == tokens
    assert not set(as_ids.prompt) & builder.tokenizer.special_token_ids


def test_chat_shared_prefix_is_a_token_prefix(builder: PromptBuilder) -> None:
    rng = random.Random(0)
    group = [builder.chat(n, rng, prefix=(3, 64)) for n in (80, 200, 500)]
    other = builder.chat(200, rng, prefix=(4, 64))
    prefix = ids(builder, [group[0].messages[0]], gen=False)  # type: ignore[index]
    assert len(prefix) == 64
    for built in group:
        full = ids(builder, built.messages or [])
        assert len(full) == built.prompt_tokens and full[:64] == prefix
    assert ids(builder, other.messages or [])[:64] != prefix


def test_completion_shared_prefix_does_not_merge(builder: PromptBuilder) -> None:
    rng = random.Random(0)
    a, b = (builder.completion(n, rng, prefix=(1, 128)) for n in (300, 200))
    ta, tb = (builder.tokenizer.encode(str(x.prompt)) for x in (a, b))
    assert (len(ta), len(tb)) == (300, 200)
    assert ta[:128] == tb[:128] and ta[128:200] != tb[128:200]


def test_trace_blocks_share_equal_hash_ids(builder: PromptBuilder) -> None:
    rng = random.Random(0)
    a = builder.completion(1100, rng, hash_ids=[7, 8, 9], block_tokens=512, token_ids=True)
    b = builder.completion(700, rng, hash_ids=[7, 5], block_tokens=512, token_ids=True)
    assert (len(a.prompt or []), len(b.prompt or [])) == (1100, 700)
    assert a.prompt[:512] == b.prompt[:512] and a.prompt[512:700] != b.prompt[512:700]  # type: ignore[index]


def test_a_conversation_grows_by_exactly_the_turn(builder: PromptBuilder) -> None:
    rng = random.Random(0)
    first = builder.chat(60, rng)
    history = [*(first.messages or []), {"role": "assistant", "content": "Fine, and you? ÿ€"}]
    before = builder.count_chat(history, add_generation_prompt=False)
    second = builder.chat(25, rng, history=history)
    assert second.prompt_tokens == before + 25 == builder.count_chat(second.messages or [])
    assert (second.messages or [])[: len(history)] == history


def test_too_short_for_the_template(builder: PromptBuilder) -> None:
    with pytest.raises(PromptError, match="shorter than the 11 tokens"):
        builder.chat(5, random.Random(0))


def test_only_hf_tokenizers_build_prompts() -> None:
    with pytest.raises(PromptError, match="hf:<dir>"):
        PromptBuilder.from_spec("estimate")
    with pytest.raises(PromptError, match="not a directory"):
        PromptBuilder.from_spec("hf:/no/such/dir")
