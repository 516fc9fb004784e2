"""JSON bodies of vLLM's OpenAI answers: completions, chat, their stream chunks, usage, models."""

from __future__ import annotations

import base64
import math
import struct
import uuid
from collections.abc import Sequence
from typing import Any, Literal

Kind = Literal["chat", "completion"]


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """vLLM's usage object; ``prompt_tokens_details`` only for a truthy ``cached_tokens`` (vLLM
    fills it only with ``--enable-prompt-tokens-details`` and a non-zero cache hit)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens} if cached_tokens else None,
    }


def _envelope(
    kind: Kind, request_id: str, created: int, model: str, stream: bool
) -> dict[str, Any]:
    if kind == "chat":
        obj = "chat.completion.chunk" if stream else "chat.completion"
    else:
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model}


def final_response(
    kind: Kind,
    request_id: str,
    created: int,
    model: str,
    choices: Sequence[tuple[int, str, str]],  # (index, text, finish_reason)
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None = None,
) -> dict[str, Any]:
    body = _envelope(kind, request_id, created, model, stream=False)
    if kind == "chat":
        body["choices"] = [
            {
                "index": index,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": None,
                "finish_reason": reason,
                "stop_reason": None,
            }
            for index, text, reason in choices
        ]
    else:
        body["choices"] = [
            {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            for index, text, reason in choices
        ]
    body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
    return body


def chunk(
    kind: Kind,
    request_id: str,
    created: int,
    model: str,
    index: int,
    text: str,
    finish_reason: str | None,
    *,
    role: bool = False,
) -> dict[str, Any]:
    """One stream event of one choice; ``role`` marks chat's opening assistant-role delta."""
    body = _envelope(kind, request_id, created, model, stream=True)
    choice: dict[str, Any]
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
        choice = {"index": index, "delta": delta, "logprobs": None}
    else:
        choice = {"index": index, "text": text, "logprobs": None}
    choice["finish_reason"] = finish_reason
    choice["stop_reason"] = None
    body["choices"] = [choice]
    return body


def usage_chunk(
    kind: Kind,
    request_id: str,
    created: int,
    model: str,
    prompt: int,
    completion: int,
    cached_tokens: int | None = None,
) -> dict[str, Any]:
    """The last event with ``stream_options.include_usage``: no choices, only usage."""
    body = _envelope(kind, request_id, created, model, stream=True)
    body["choices"] = []
    body["usage"] = usage(prompt, completion, cached_tokens)
    return body


def models(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model, created, max_model_len)]}


def model_card(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    """One entry of ``/v1/models``; also the body of ``/v1/models/{id}``."""
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": model,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": f"modelperm-{model}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


def embeddings(
    model: str,
    created: int,
    prompts: Sequence[Sequence[int]],
    size: int,
    encoding_format: object = None,
) -> dict[str, Any]:
    """vLLM's embeddings answer: one deterministic unit vector per prompt (a function of its
    token ids), ``usage`` with the prompts' tokens; base64 when asked (float32, little end)."""
    data = []
    for index, ids in enumerate(prompts):
        raw = [math.sin((i + 1) * (sum(ids) % 997 + 1)) for i in range(size)]
        norm = math.sqrt(sum(x * x for x in raw)) or 1.0
        vector = [x / norm for x in raw]
        embedding: Any = vector
        if encoding_format == "base64":
            embedding = base64.b64encode(struct.pack(f"<{size}f", *vector)).decode()
        data.append({"index": index, "object": "embedding", "embedding": embedding})
    tokens = sum(len(ids) for ids in prompts)
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": created,
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }
