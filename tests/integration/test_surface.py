"""The rest of the surface through a real gateway over real sockets, simulated engines behind:
models.retrieve, embeddings, tokenize/detokenize, /version, the counting headers, tools and
the engines' chat flags, media refused or counted at their worst case, tenant keys and
limits on every new endpoint, OpenAI-style 404s."""

from __future__ import annotations

import dataclasses
import hashlib

import httpx
import openai
import pytest

from gateway.core.kvmath import ceil_div
from gateway.media import FAMILIES
from gateway.tokens import HfTokenizer, bundled_tokenizer_path
from gateway.tokens.chat import ChatInput
from gateway.tokens.tools import dump_tools
from tests.integration.conftest import FAST, gateway_over
from tests.media.images import data_url, image_bytes, image_part

TINY = HfTokenizer.load(bundled_tokenizer_path())
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "noop", "description": "Does nothing."}},
]
MESSAGES = [{"role": "user", "content": "Find the capital of France."}]


def client(url: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


async def test_models_retrieve_and_embeddings_create_with_the_sdk() -> None:
    async with (
        gateway_over([FAST]) as gw,
        client(gw.url) as sdk,
        client(gw.engines[0].url) as direct,
    ):
        model = await sdk.models.retrieve("tiny")
        assert (model.id, model.object, model.owned_by) == ("tiny", "model", "kv-gateway")
        with pytest.raises(openai.NotFoundError) as missing:
            await sdk.models.retrieve("gpt-none")
        assert missing.value.code == "model_not_found"
        inputs = ["one prompt", "and another, longer prompt"]
        raw = await sdk.embeddings.with_raw_response.create(model="tiny", input=inputs)
        got = raw.parse()
        expected = await direct.embeddings.create(model="tiny", input=inputs)
        assert [d.embedding for d in got.data] == [d.embedding for d in expected.data]
        tokens = [len(TINY.encode(t)) for t in inputs]
        assert (
            got.usage.prompt_tokens == sum(tokens) == int(raw.headers["x-kv-gateway-prompt-tokens"])
        )
        # Prompts alone, no output: one 16-token block per prompt here.
        blocks = sum(ceil_div(t, 16) for t in tokens)
        assert int(raw.headers["x-kv-gateway-blocks"]) == blocks
        assert await gw.reserved_blocks_settle() == [0]


async def test_headers_count_each_prompt_once_and_block_every_sequence() -> None:
    async with gateway_over([FAST]) as gw, httpx.AsyncClient(timeout=30) as http:
        prompts = ["first prompt of a batch", "second, a little longer prompt of the batch"]
        body = {"model": "tiny", "prompt": prompts, "max_tokens": 5, "n": 3}
        answer = await http.post(f"{gw.url}/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        tokens = [len(TINY.encode(p)) for p in prompts]
        counted = int(answer.headers["x-kv-gateway-prompt-tokens"])
        assert counted == sum(tokens) == answer.json()["usage"]["prompt_tokens"]
        blocks = 3 * sum(ceil_div(t + 5, 16) for t in tokens)
        assert int(answer.headers["x-kv-gateway-blocks"]) == blocks


async def test_tools_count_as_the_engine_renders_them() -> None:
    async with gateway_over([FAST]) as gw, client(gw.url) as sdk:
        raw = await sdk.chat.completions.with_raw_response.create(
            model="tiny",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="none",
            max_tokens=2,  # type: ignore[arg-type]
        )
        answer = raw.parse()
        assert answer.usage is not None
        plain = TINY.count_chat(MESSAGES)
        counted = int(raw.headers["x-kv-gateway-prompt-tokens"])
        assert counted == answer.usage.prompt_tokens > plain + 50


async def test_tools_dropped_only_when_every_engine_drops_them() -> None:
    flags = {"exclude_tools_when_tool_choice_none": True}
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 2}
    rendered = TINY.render_chat(ChatInput(MESSAGES, tools=dump_tools(TOOLS)))
    with_tools = len(TINY.encode(rendered, add_special_tokens=False))
    plain = TINY.count_chat(MESSAGES)
    for engines, tool_choice, expected in [
        ([flags, flags], "none", plain),
        ([flags, {}], "none", with_tools),  # one engine would render them: counted
        ([flags, flags], "auto", with_tools),
    ]:
        async with (
            gateway_over([FAST] * 2, engine_settings=engines) as gw,
            httpx.AsyncClient(timeout=30) as http,
        ):
            answer = await http.post(
                f"{gw.url}/v1/chat/completions", json={**body, "tool_choice": tool_choice}
            )
            counted = int(answer.headers["x-kv-gateway-prompt-tokens"])
            assert counted == expected, (engines, tool_choice)


async def test_request_chat_templates_need_a_trusting_engine() -> None:
    body = {"model": "tiny", "messages": MESSAGES, "chat_template": "{{ messages[0].content }}"}
    async with gateway_over([FAST]) as gw, httpx.AsyncClient(timeout=30) as http:
        answer = await http.post(f"{gw.url}/v1/chat/completions", json=body)
        assert answer.status_code == 400
        assert "--trust-request-chat-template" in answer.json()["error"]["message"]
        assert gw.engines[0].sim.request_ids.total == 0  # refused before reaching an engine
    trusting = [{"trust_request_chat_template": True}]
    async with (
        gateway_over([FAST], engine_settings=trusting) as gw,
        httpx.AsyncClient(timeout=30) as http,
    ):
        answer = await http.post(f"{gw.url}/v1/chat/completions", json=body)
        # Counted with the request's template (its one message's text), then the engine's say.
        assert int(answer.headers["x-kv-gateway-prompt-tokens"]) == len(
            TINY.encode(MESSAGES[0]["content"], add_special_tokens=False)
        )


async def test_bad_input_is_refused_before_any_reservation() -> None:
    media = {"models": [{"name": "tiny", "tokenizer": "hf:@tiny", "media": {"family": "qwen2_vl"}}]}
    bad_bodies = [
        (
            {"tools": [{"type": "function", "function": {"parameters": {}}}]},
            "name must be a string",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "strict"),
        (
            {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
            "unsupported content part type",
        ),
        (
            {"messages": [{"role": "user", "content": [image_part("data:image/png;base64,%%%")]}]},
            "not valid base64",
        ),
        (
            {"messages": [{"role": "user", "content": [image_part(data_url(b"GIF89a broken"))]}]},
            "cannot read the image",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [image_part(data_url(image_bytes(4000, 2)))]}
                ]
            },
            "aspect ratio",
        ),
        ({"continue_final_message": True}, "add_generation_prompt"),
        ({"chat_template_kwargs": "enable_thinking"}, "must be an object"),
        ({"documents": [{"title": 1}]}, "documents"),
    ]
    async with gateway_over([FAST], **media) as gw, httpx.AsyncClient(timeout=30) as http:
        for extra, message in bad_bodies:
            body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **extra}
            answer = await http.post(f"{gw.url}/v1/chat/completions", json=body)
            assert answer.status_code == 400, (extra, answer.text)
            error = answer.json()["error"]
            assert message in error["message"], (extra, error)
            assert error["type"] == "invalid_request_error"
        assert gw.engines[0].sim.request_ids.total == 0  # nothing reached the engine
        assert await gw.reserved_blocks_settle() == [0]


async def test_media_without_configuration_or_worst_case_is_refused() -> None:
    image = [{"role": "user", "content": [image_part("http://images.invalid/cat.png")]}]
    async with gateway_over([FAST]) as gw, httpx.AsyncClient(timeout=30) as http:
        answer = await http.post(
            f"{gw.url}/v1/chat/completions", json={"model": "tiny", "messages": image}
        )
        assert answer.status_code == 400
        assert "not configured for media input" in answer.json()["error"]["message"]
    video = [
        {
            "role": "user",
            "content": [{"type": "video_url", "video_url": {"url": "http://v.invalid/a.mp4"}}],
        }
    ]
    configured = {
        "models": [{"name": "tiny", "tokenizer": "hf:@tiny", "media": {"family": "qwen2_vl"}}]
    }
    async with gateway_over([FAST], **configured) as gw, httpx.AsyncClient(timeout=30) as http:
        answer = await http.post(
            f"{gw.url}/v1/chat/completions", json={"model": "tiny", "messages": video}
        )
        assert answer.status_code == 400
        assert "worst_case.video" in answer.json()["error"]["message"]


async def test_uncountable_media_is_admitted_at_its_worst_case() -> None:
    # A remote image (fetching off) and a video, counted at their configured worst cases: the
    # reservation holds them. The simulated engine is a text model and refuses the request
    # afterwards (400, nothing generated, everything released).
    media = {"family": "qwen2_vl", "max_pixels": 1280 * 784, "worst_case": {"video": 3000}}
    configured = {"models": [{"name": "tiny", "tokenizer": "hf:@tiny", "media": media}]}
    content = [
        image_part("http://images.invalid/cat.png"),
        {"type": "video_url", "video_url": {"url": "http://v.invalid/a.mp4"}},
        {"type": "text", "text": "Describe both."},
    ]
    messages = [{"role": "user", "content": content}]
    # The family's placeholders are rendered where vLLM writes them; this text-only tokenizer
    # has no pad token to expand, so each item's tokens count on top.
    placeholders = FAMILIES["qwen2_vl"].template.placeholders
    rendered = TINY.render_chat(ChatInput(messages), placeholders=placeholders)
    text = len(TINY.encode(rendered, add_special_tokens=False))
    sim = dataclasses.replace(FAST, max_model_len=8192, num_gpu_blocks=4096)

    async with (
        gateway_over([sim], **configured) as gw,
        httpx.AsyncClient(timeout=30) as http,
    ):
        answer = await http.post(
            f"{gw.url}/v1/chat/completions",
            json={"model": "tiny", "messages": messages, "max_tokens": 4},
        )
        assert answer.status_code == 400  # the text-only engine's own refusal, passed on
        counted = int(answer.headers["x-kv-gateway-prompt-tokens"])
        assert counted == text + 1280 + 3000
        assert await gw.reserved_blocks_settle() == [0]


async def test_tokenize_detokenize_version_and_unknown_paths() -> None:
    async with gateway_over([FAST]) as gw, httpx.AsyncClient(timeout=30) as http:
        body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS}
        through = await http.post(f"{gw.url}/tokenize", json=body)
        direct = await http.post(f"{gw.engines[0].url}/tokenize", json=body)
        assert through.status_code == 200 and through.json() == direct.json()
        assert through.headers["x-kv-gateway-blocks"] == "0"
        tokens = through.json()["tokens"]
        detok = await http.post(f"{gw.url}/detokenize", json={"model": "tiny", "tokens": tokens})
        assert detok.json()["prompt"] == TINY.render_chat(
            ChatInput(MESSAGES, tools=dump_tools(TOOLS))
        )
        version = await http.get(f"{gw.url}/version")
        assert version.json()["server"] == "kv-gateway"
        for method, path in [
            ("GET", "/v1/nothing"),
            ("POST", "/v2/chat"),
            ("GET", "/v1/models/tiny/x"),
        ]:
            answer = await http.request(method, f"{gw.url}{path}")
            assert answer.status_code == 404, path
            assert answer.json()["error"]["type"] == "invalid_request_error"
        missing = await http.post(f"{gw.url}/tokenize", json={"prompt": "no model"})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def test_every_new_endpoint_needs_a_tenant_key_and_counts_against_its_limits() -> None:
    tenants = [{"name": "acme", "api_keys": [_digest("k-acme")], "rpm": 6}]
    calls = [
        ("GET", "/v1/models/tiny", None),
        ("GET", "/version", None),
        ("POST", "/v1/embeddings", {"model": "tiny", "input": "x"}),
        ("POST", "/tokenize", {"model": "tiny", "prompt": "x"}),
        ("POST", "/detokenize", {"model": "tiny", "tokens": [1, 2]}),
        ("POST", "/v1/responses", {"model": "tiny", "input": "x"}),
        ("POST", "/score", {"model": "tiny", "queries": "a", "documents": ["b"]}),
        ("POST", "/rerank", {"model": "tiny", "query": "a", "documents": ["b"]}),
        ("POST", "/pooling", {"model": "tiny", "input": "x"}),
    ]
    async with gateway_over([FAST], tenants=tenants) as gw, httpx.AsyncClient(timeout=30) as http:
        for method, path, body in calls:
            answer = await http.request(method, f"{gw.url}{path}", json=body)
            assert answer.status_code == 401, (path, answer.text)
            assert answer.json()["error"]["code"] == "invalid_api_key"
        key = {"authorization": "Bearer k-acme"}
        admitted = [c for c in calls if c[0] == "POST"]
        statuses = [
            (await http.request(m, f"{gw.url}{p}", json=b, headers=key)).status_code
            for m, p, b in admitted
        ]
        # rpm 6: six admitted (the engine answers what it serves, 404 what it does not), then
        # 429 from the gateway, before any engine is asked.
        assert all(s != 429 for s in statuses[:6]), statuses
        assert statuses[6:] == [429] * (len(admitted) - 6), statuses
