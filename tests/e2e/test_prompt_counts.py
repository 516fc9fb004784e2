"""Every token the engine will hold, counted: tools, template options and continued messages.

For each chat below, the prompt tokens the real engine reports (`usage.prompt_tokens` of a
direct chat completion) must equal, exactly:

- the `hf:` counter's count (the gateway's own rendering of the model's template),
- the `engine` counter's count (the engine's `/tokenize`, sent the same fields),
- the gateway's `x-kv-gateway-prompt-tokens` header on the same request sent through it, with
  either counter — and the engine's own `usage.prompt_tokens` in that answer.

The tiny model's template renders tools, tool calls, tool results and documents as Qwen2.5's
and Hermes' templates do, and honours `enable_thinking` (tools/build_tokenizer.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import httpx
import openai
import pytest

from gateway.request import parse_body
from gateway.tokens import make_counter
from tests.e2e.gateway_process import (
    TOKENIZER_DIR,
    GatewayProcess,
    gateway_config,
    serving_gateway,
)

pytestmark = pytest.mark.vllm

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
                "where": {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat"],
                },
            },
            "required": ["city"],
        },
    },
}
BARE = {"type": "function", "function": {"name": "ping"}}  # no description, no parameters
STRICT = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "strict": True,
        "x-unknown": "dropped by vLLM's request model",
    },
    "defer_loading": False,
}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
]
HISTORY = [
    *MESSAGES,
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
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "windy"}]},
]

CASES: list[tuple[str, dict[str, Any]]] = [
    ("tools", {"messages": MESSAGES, "tools": [WEATHER, BARE, STRICT], "tool_choice": "none"}),
    ("tools-and-history", {"messages": HISTORY, "tools": [WEATHER], "tool_choice": "none"}),
    (
        "kwargs-enable-thinking",
        {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}},
    ),
    (
        "documents",
        {"messages": MESSAGES, "documents": [{"title": "Paris", "text": "Capital of France."}]},
    ),
    (
        "kwargs-documents",
        {
            "messages": MESSAGES,
            "chat_template_kwargs": {"documents": [{"title": "A", "text": "a"}]},
        },
    ),
    (
        "continue-final-message",
        {
            "messages": [*MESSAGES, {"role": "assistant", "content": "The weather is"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    ),
    ("reasoning-effort-none", {"messages": MESSAGES, "reasoning_effort": "none"}),
    ("no-generation-prompt", {"messages": MESSAGES, "add_generation_prompt": False}),
]
IDS = [name for name, _ in CASES]


def _body(case: dict[str, Any]) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 1, "temperature": 0.0, **case}


@pytest.fixture(scope="module")
def direct_counts(vllm_url: str) -> dict[str, int]:
    """What the engine itself reports for each case (`usage.prompt_tokens`)."""
    counts: dict[str, int] = {}
    with httpx.Client(timeout=120) as http:
        for name, case in CASES:
            answer = http.post(f"{vllm_url}/v1/chat/completions", json=_body(case))
            assert answer.status_code == 200, (name, answer.text)
            counts[name] = answer.json()["usage"]["prompt_tokens"]
    return counts


@pytest.fixture(scope="module")
def engine_gateway(
    vllm_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """A second gateway in front of the same engine, counting with its `/tokenize`."""
    config = gateway_config(vllm_url)
    config["models"] = [{"name": "tiny", "tokenizer": "engine"}]
    with serving_gateway(config, tmp_path_factory.mktemp("engine-gateway")) as gw:
        yield gw


@pytest.mark.parametrize(("name", "case"), CASES, ids=IDS)
async def test_counters_equal_vllm_usage(
    vllm_url: str, direct_counts: dict[str, int], name: str, case: dict[str, Any]
) -> None:
    inbound = parse_body(json.dumps(_body(case)).encode(), "chat")
    assert inbound.chat is not None
    hf = make_counter(f"hf:{TOKENIZER_DIR}", model="tiny")
    async with aiohttp.ClientSession() as session:
        engine = make_counter(
            "engine", model="tiny", tokenize_urls=lambda: [vllm_url], client=session
        )
        from_engine = await engine.count_chat(inbound.chat)
    from_hf = await hf.count_chat(inbound.chat)
    assert from_hf.count == direct_counts[name]
    assert from_engine.count == direct_counts[name]
    # Both counters give the prompt's ids (for the prefix credit), and the same ones.
    assert list(from_hf.ids() or []) == list(from_engine.ids() or []) != []


@pytest.mark.parametrize("counter", ["hf", "engine"])
def test_gateway_headers_equal_vllm_usage(
    gateway: GatewayProcess,
    engine_gateway: GatewayProcess,
    direct_counts: dict[str, int],
    counter: str,
) -> None:
    through = gateway if counter == "hf" else engine_gateway
    with openai.OpenAI(base_url=f"{through.url}/v1", api_key="e2e", max_retries=0) as client:
        for name, case in CASES:
            body = _body(case)
            extra = {k: v for k, v in body.items() if k not in ("model", "messages", "max_tokens")}
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", messages=body["messages"], max_tokens=1, extra_body=extra
            )
            answer = raw.parse()
            assert answer.usage is not None
            counted = int(raw.headers["x-kv-gateway-prompt-tokens"])
            assert counted == answer.usage.prompt_tokens == direct_counts[name], name
            # One sequence of prompt + 1 output token, in 128-token blocks.
            assert int(raw.headers["x-kv-gateway-blocks"]) == (counted + 1 + 127) // 128, name


def test_tools_without_tool_choice_are_the_engines_to_refuse(gateway: GatewayProcess) -> None:
    # vLLM 0.32 refuses tool_choice "auto" (the default once tools are given) without
    # --enable-auto-tool-choice: the gateway counts, admits, and passes the 400 on.
    answer = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": "tiny", "messages": MESSAGES, "tools": [WEATHER], "max_tokens": 1},
        timeout=60,
    )
    assert answer.status_code == 400, answer.text
    assert "auto" in answer.json()["error"]["message"]


def test_malformed_tools_are_refused_before_reservation(gateway: GatewayProcess) -> None:
    for tools, expected in [
        ([{"type": "function", "function": {"description": "no name"}}], "name must be a string"),
        ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "parameters"),
        ([{"type": "custom", "custom": {"name": "f"}}], "must be 'function'"),
        ([], "must not be an empty array"),
    ]:
        answer = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json={"model": "tiny", "messages": MESSAGES, "tools": tools, "tool_choice": "none"},
            timeout=60,
        )
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert expected in error["message"] and error["param"] == "tools"
        assert "x-kv-gateway-blocks" not in answer.headers  # nothing was reserved
