"""vLLM's OpenAI surface of the simulator: shapes, streaming, errors, /tokenize, models."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai

from gateway.tokens.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer
from tests.sim.conftest import SimFactory

TOKENIZER = HfTokenizer.load(BUNDLED_TOKENIZER_DIR)
MESSAGES = [{"role": "user", "content": "How many blocks does this take?"}]


async def test_models_health_version(sim: SimFactory, client: httpx.AsyncClient) -> None:
    async with sim(max_model_len=512, num_gpu_blocks=64) as url:
        models = (await client.get(f"{url}/v1/models")).json()
        (card,) = models["data"]
        assert models["object"] == "list"
        assert card["id"] == "tiny" and card["object"] == "model" and card["owned_by"] == "vllm"
        assert card["max_model_len"] == 512 and card["parent"] is None
        health = await client.get(f"{url}/health")
        assert health.status_code == 200 and health.content == b""
        assert "version" in (await client.get(f"{url}/version")).json()


async def test_tokenize_counts_prompts_and_rendered_chats(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim() as url:
        got = (await client.post(f"{url}/tokenize", json={"prompt": "hello world"})).json()
        assert got == {
            "count": len(TOKENIZER.encode("hello world")),
            "max_model_len": 2048,
            "tokens": TOKENIZER.encode("hello world"),
            "token_strs": None,
        }
        chat = {"model": "tiny", "messages": MESSAGES, "add_generation_prompt": True}
        got = (await client.post(f"{url}/tokenize", json=chat)).json()
        assert got["count"] == TOKENIZER.count_chat(MESSAGES)


async def test_chat_usage_counts_the_rendered_template(sim: SimFactory) -> None:
    async with sim() as url:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        reply = await api.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=7, extra_body={"ignore_eos": True}
        )
        assert reply.usage is not None
        assert reply.usage.prompt_tokens == TOKENIZER.count_chat(MESSAGES)
        assert reply.usage.completion_tokens == 7
        assert reply.choices[0].finish_reason == "length"
        assert reply.choices[0].message.role == "assistant"
        await api.close()


async def test_streaming_format_and_usage(sim: SimFactory, client: httpx.AsyncClient) -> None:
    async with sim() as url:
        body = {
            "model": "tiny",
            "messages": MESSAGES,
            "max_tokens": 5,
            "ignore_eos": True,
            "seed": 7,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            raw = (await resp.aread()).decode()
        events = raw.split("\n\n")
        assert events[-1] == "" and events[-2] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
        assert all(e.startswith("data: ") for e in events[:-1])
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        content = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
        assert len(content) == 5
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == 5
        # The same request without streaming generates the same text (same seed).
        plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        reply = (await client.post(f"{url}/v1/chat/completions", json=plain)).json()
        assert reply["choices"][0]["message"]["content"] == "".join(content)


async def test_openai_client_streams_completions(sim: SimFactory) -> None:
    async with sim() as url:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        stream = await api.completions.create(
            model="tiny",
            prompt="one two three",
            max_tokens=4,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        texts: dict[int, str] = {0: "", 1: ""}
        usage = None
        async for part in stream:
            for choice in part.choices:
                texts[choice.index] += choice.text
            usage = part.usage or usage
        assert usage is not None and usage.completion_tokens == 8
        assert usage.prompt_tokens == len(TOKENIZER.encode("one two three"))
        assert texts[0] and texts[1] and texts[0] != texts[1]
        await api.close()


PROMPT_FORMS: list[tuple[Any, int]] = [
    ("a string", 1),
    (["one", "two", "three"], 3),
    ([5, 6, 7, 8], 1),
    ([[5, 6], [7, 8, 9]], 2),
]


async def test_completion_prompt_forms(sim: SimFactory, client: httpx.AsyncClient) -> None:
    async with sim() as url:
        for prompt, num_prompts in PROMPT_FORMS:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "n": 2}
            body["ignore_eos"] = True
            reply = (await client.post(f"{url}/v1/completions", json=body)).json()
            assert [c["index"] for c in reply["choices"]] == list(range(2 * num_prompts))
            assert reply["usage"]["completion_tokens"] == 4 * num_prompts


async def test_output_is_deterministic_and_eos_bounded(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim() as url:
        reasons = set()
        for seed in range(12):
            body = {"model": "tiny", "prompt": "x", "max_tokens": 60, "seed": seed}
            first = (await client.post(f"{url}/v1/completions", json=body)).json()
            again = (await client.post(f"{url}/v1/completions", json=body)).json()
            assert first["choices"][0]["text"] == again["choices"][0]["text"]
            assert 1 <= first["usage"]["completion_tokens"] <= 60
            reasons.add(first["choices"][0]["finish_reason"])
        assert reasons == {"stop", "length"}
        # Omitted max_tokens: vLLM's completions default is 16.
        body = {"model": "tiny", "prompt": "x", "ignore_eos": True}
        reply = (await client.post(f"{url}/v1/completions", json=body)).json()
        assert reply["usage"]["completion_tokens"] == 16


async def test_chat_without_max_tokens_may_use_the_whole_context(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(max_model_len=64, num_gpu_blocks=16) as url:
        body = {"model": "tiny", "messages": MESSAGES, "ignore_eos": True}
        reply = (await client.post(f"{url}/v1/chat/completions", json=body)).json()
        usage = reply["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
        # A completion's explicit `"max_tokens": null` is the same: up to the context's end
        # (only a left-out field means vLLM's default of 16).
        body = {"model": "tiny", "prompt": "x", "max_tokens": None, "ignore_eos": True}
        reply = (await client.post(f"{url}/v1/completions", json=body)).json()
        usage = reply["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 64


def _error(status: int, error_type: str, message: str) -> tuple[int, str, str]:
    return status, error_type, message


# Over-long requests have their own table in test_http_max_tokens.py.
ERROR_CASES: list[tuple[str, Any, tuple[int, str, str]]] = [
    (
        "/v1/completions",
        {"model": "nope", "prompt": "x"},
        _error(404, "NotFoundError", "The model `nope` does not exist."),
    ),
    ("/v1/completions", b"{not json", _error(400, "BadRequestError", "not valid JSON")),
    ("/v1/completions", [1, 2], _error(400, "BadRequestError", "JSON object")),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "x", "max_tokens": "3"},
        _error(400, "BadRequestError", "'max_tokens' must be an integer"),
    ),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": []},
        _error(400, "BadRequestError", "'prompt' must be"),
    ),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "x", "n": 0},
        _error(400, "BadRequestError", "n must be at least 1"),
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": "hi"},
        _error(400, "BadRequestError", "'messages'"),
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": MESSAGES, "stream_options": {"include_usage": True}},
        _error(400, "BadRequestError", "Stream options"),
    ),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "x", "cache_salt": ""},
        _error(400, "BadRequestError", "'cache_salt' must be a non-empty string"),
    ),
    (
        "/v1/completions",  # the tiny tokenizer adds no BOS: no token at all (was a 500)
        {"model": "tiny", "prompt": ""},
        _error(400, "BadRequestError", "The decoder prompt cannot be empty"),
    ),
    ("/tokenize", {"prompt": 3}, _error(400, "BadRequestError", "'prompt'")),
    ("/tokenize", {"model": "nope", "prompt": "x"}, _error(404, "NotFoundError", "nope")),
]


async def test_errors_have_vllm_shape(sim: SimFactory, client: httpx.AsyncClient) -> None:
    async with sim(max_model_len=64, num_gpu_blocks=16) as url:
        for path, body, (status, error_type, message) in ERROR_CASES:
            if isinstance(body, bytes):
                resp = await client.post(f"{url}{path}", content=body)
            else:
                resp = await client.post(f"{url}{path}", json=body)
            assert resp.status_code == status, (path, body)
            error = resp.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == error_type and error["code"] == status
            assert message in error["message"], (error, message)
        st = (await client.get(f"{url}/sim/state")).json()
        assert st["used_blocks"] == 0 and st["requests"] == []  # nothing was admitted


async def test_a_model_can_be_retrieved_by_id(sim: SimFactory, client: httpx.AsyncClient) -> None:
    """GET /v1/models/{id}: an extension (vLLM serves only the list), for models.retrieve."""
    async with sim(served_model_name="org/tiny-1", max_model_len=512, num_gpu_blocks=64) as url:
        listed = (await client.get(f"{url}/v1/models")).json()["data"][0]
        reply = await client.get(f"{url}/v1/models/org/tiny-1")
        assert reply.status_code == 200 and reply.json() == listed
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        model = await api.models.retrieve("org/tiny-1")
        assert model.id == "org/tiny-1" and model.owned_by == "vllm"
        missing = await client.get(f"{url}/v1/models/nope")
        assert missing.status_code == 404
        assert missing.json() == {
            "error": {
                "message": "The model `nope` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        }
        await api.close()
