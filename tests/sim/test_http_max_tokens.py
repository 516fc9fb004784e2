"""Over-long requests as vLLM 0.32 answers them: clamp what fits, 400 for what cannot."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.sim.server import max_chars_per_token
from gateway.tokens.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer
from tests.sim.conftest import SimFactory, state

TOKENIZER = HfTokenizer.load(BUNDLED_TOKENIZER_DIR)
MAX_CHARS = 64 * max_chars_per_token(TOKENIZER)  # max_model_len 64 below
LIMITS = dict(max_model_len=64, num_gpu_blocks=16)
MESSAGES = [{"role": "user", "content": "How long may my answer be?"}]


def _ids(n: int) -> list[int]:
    return list(range(100, 100 + n))


# (path, body, expected output tokens) — each answered 200 with finish_reason "length".
CLAMPED: list[tuple[str, dict[str, Any], int]] = [
    # prompt 30 + max_tokens 40 > 64: generates the 34 that fit.
    ("/v1/completions", {"prompt": _ids(30), "max_tokens": 40}, 34),
    ("/v1/completions", {"prompt": _ids(63), "max_tokens": 64}, 1),
    ("/v1/completions", {"prompt": [_ids(30), _ids(60)], "max_tokens": 40}, 34 + 4),
    ("/v1/completions", {"prompt": _ids(60)}, 4),  # vLLM's default of 16, clamped
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_completion_tokens": 64},
        64 - TOKENIZER.count_chat(MESSAGES),
    ),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 60, "stream": True},
        64 - TOKENIZER.count_chat(MESSAGES),
    ),
]


@pytest.mark.parametrize(("path", "body", "output"), CLAMPED)
async def test_max_tokens_beyond_the_context_is_clamped(
    sim: SimFactory, client: httpx.AsyncClient, path: str, body: dict[str, Any], output: int
) -> None:
    async with sim(**LIMITS) as url:
        reply = await client.post(
            f"{url}{path}", json={"model": "tiny", "ignore_eos": True, **body}
        )
        assert reply.status_code == 200, reply.text
        if body.get("stream"):
            events = [e.removeprefix("data: ") for e in reply.text.split("\n\n") if e]
            chunks = [e for e in events if e.startswith("{")]
            reasons = [c for c in chunks if '"finish_reason":"length"' in c]
            assert len(chunks) == 1 + output and len(reasons) == 1  # role chunk + tokens
        else:
            answer = reply.json()
            assert answer["usage"]["completion_tokens"] == output
            assert {c["finish_reason"] for c in answer["choices"]} == {"length"}


# (body, param, message) — each a 400 BadRequestError the engine never sees.
REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 65},
        "max_tokens",
        "max_tokens=65 cannot be greater than max_model_len=64. Please request fewer "
        "output tokens.",
    ),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_completion_tokens": 100},
        "max_completion_tokens",
        "max_completion_tokens=100 cannot be greater than max_model_len=64.",
    ),
    (  # checked before the prompt: its length does not matter
        "/v1/completions",
        {"prompt": _ids(80), "max_tokens": 65},
        "max_tokens",
        "max_tokens=65 cannot be greater than max_model_len=64.",
    ),
    (  # the prompt alone fills the context: no room for one output token
        "/v1/completions",
        {"prompt": _ids(64), "max_tokens": 10},
        "max_tokens",
        "max_tokens must be at least 1, got 0.",
    ),
    (
        "/v1/completions",
        {"prompt": _ids(65)},
        "input_tokens",
        "You passed 65 input tokens and requested 0 output tokens. However, the model's "
        "context length is only 64 tokens, resulting in a maximum input length of 64 "
        "tokens.",
    ),
    (
        "/v1/completions",
        {"prompt": ["short", "a" * (MAX_CHARS + 1)], "max_tokens": 5},
        "input_text",
        f"You passed {MAX_CHARS + 1} input characters and requested 5 output tokens. "
        f"However, the model's context length is only 64 tokens, resulting in a maximum "
        f"input length of 64 tokens (at most {MAX_CHARS} characters).",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": " ".join(["word"] * 70)}]},
        "input_tokens",
        "However, the model's context length is only 64 tokens",
    ),
]


@pytest.mark.parametrize(("path", "body", "param", "message"), REFUSED)
async def test_what_cannot_fit_is_a_400_in_vllm_shape(
    sim: SimFactory,
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    param: str,
    message: str,
) -> None:
    async with sim(**LIMITS) as url:
        reply = await client.post(f"{url}{path}", json={"model": "tiny", **body})
        assert reply.status_code == 400
        assert reply.json() == {
            "error": {
                "message": reply.json()["error"]["message"],
                "type": "BadRequestError",
                "param": param,
                "code": 400,
            }
        }
        assert message in reply.json()["error"]["message"]
        st = await state(client, url)
        assert st["requests"] == [] and st["used_blocks"] == 0
