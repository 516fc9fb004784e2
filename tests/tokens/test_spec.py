"""make_counter: spec validation; prompt_token_counts: the completions prompt forms."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from gateway.tokens import (
    BUNDLED_TOKENIZER_DIR,
    EngineCounter,
    EstimateCounter,
    HfCounter,
    PromptTypeError,
    TiktokenCounter,
    make_counter,
    prompt_token_counts,
)


@pytest.mark.parametrize(
    ("spec", "kind", "name"),
    [
        ("hf:@tiny", HfCounter, "hf:@tiny"),
        (f"hf:{BUNDLED_TOKENIZER_DIR}", HfCounter, f"hf:{BUNDLED_TOKENIZER_DIR}"),
        ("tiktoken:cl100k_base", TiktokenCounter, "tiktoken:cl100k_base"),
        ("estimate", EstimateCounter, "estimate"),
        ("estimate:3.2", EstimateCounter, "estimate:3.2"),
    ],
)
def test_good_specs(spec: str, kind: type, name: str) -> None:
    counter = make_counter(spec, model="m")
    assert isinstance(counter, kind)
    assert counter.name == name


async def test_engine_spec_builds_with_urls_and_client() -> None:
    async with aiohttp.ClientSession() as client:
        counter = make_counter("engine", model="m", tokenize_urls=list, client=client)
        assert isinstance(counter, EngineCounter)


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("", "invalid token counter spec"),
        ("bogus", "invalid token counter spec"),
        ("HF:@tiny", "invalid token counter spec"),
        ("hf", "invalid token counter spec"),
        ("hf:", "invalid token counter spec"),
        ("hf:/no/such/dir", "is not a directory"),
        ("tiktoken", "invalid token counter spec"),
        ("tiktoken:", "invalid token counter spec"),
        ("tiktoken:o200k_base", "not available offline"),
        ("engine:x", "invalid token counter spec"),
        ("engine", "needs tokenize_urls"),
        ("estimate:", "invalid token counter spec"),
        ("estimate:abc", "positive number"),
        ("estimate:0", "positive number"),
        ("estimate:-2", "positive number"),
        ("estimate:nan", "positive number"),
        ("estimate:inf", "positive number"),
    ],
)
def test_bad_specs_name_the_spec(spec: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason) as info:
        make_counter(spec, model="m")
    assert repr(spec) in str(info.value)


def test_hf_dir_without_tokenizer_is_rejected(tmp_path: Path) -> None:
    spec = f"hf:{tmp_path}"
    with pytest.raises(ValueError, match=r"no tokenizer\.json") as info:
        make_counter(spec, model="m")
    assert repr(spec) in str(info.value)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("abcd", [1]),
        ("", [0]),
        (["abcd", "abcdefgh", ""], [1, 2, 0]),
        ([5, 6, 7], [3]),
        ([0], [1]),
        ([[1, 2], [3], [4, 5, 6]], [2, 1, 3]),
    ],
)
async def test_prompt_token_counts(prompt: object, expected: list[int]) -> None:
    counts = await prompt_token_counts(make_counter("estimate", model="m"), prompt)
    assert [c.count for c in counts] == expected
    # Token-id prompts are their own ids; the estimate has none for text.
    ids = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        ids = [prompt]
    assert [c.ids() for c in counts] == (ids or [None] * len(counts))


@pytest.mark.parametrize(
    "prompt",
    [
        None,
        3,
        2.5,
        {"text": "x"},
        [],
        [[]],
        ["a", 1],
        [1, "a"],
        [[1], 2],
        [True, False],
        [-1],
        [1.0],
        [[1, 2], []],
        [[1, "a"]],
        [["a"]],
        b"bytes",
    ],
)
async def test_bad_prompts_are_value_errors(prompt: object) -> None:
    with pytest.raises(PromptTypeError, match="'prompt' must be") as info:
        await prompt_token_counts(make_counter("estimate", model="m"), prompt)
    assert isinstance(info.value, ValueError)
