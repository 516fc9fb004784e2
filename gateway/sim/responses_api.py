"""vLLM's Responses API (``POST /v1/responses``): the request, its conversation, its answers.

As vLLM 0.32 builds them (``vllm/entrypoints/openai/responses/``: ``protocol.py``,
``serving.py``, ``utils.py``, ``simple_streaming_events.py``), for a model without a reasoning
or tool parser: ``instructions`` becomes a system message, then a previous response's
conversation (its system messages dropped: instructions do not carry over) and its output
text as an assistant message, then ``input`` (a string is one user message; message items
keep their role and content parts). The answer is a ``response`` object whose one output item
is the assistant's message; streamed, it is named SSE events (``event: <type>`` then
``data: <json>``, no ``[DONE]``) numbered by ``sequence_number``.

Everything here is a decision (a value or an ``ApiError``) or a JSON body; the server sends.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.sim.protocol import (
    ApiError,
    GenerationRequest,
    bad_request,
    cache_salt_of,
    chat_messages,
    check_model,
    optional_bool,
    optional_int,
)
from gateway.sim.response_store import StoredResponse

# Request fields a response repeats, with vLLM's defaults (``ResponsesRequest``).
_ECHOED: dict[str, Any] = {
    "metadata": None,
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
    "max_tool_calls": None,
    "reasoning": None,
    "service_tier": "auto",
    "text": None,
    "truncation": "disabled",
    "user": None,
}


@dataclass(frozen=True)
class ResponsesCall:
    """A ``/v1/responses`` request whose fields are valid. ``input`` is as chat messages and
    not yet joined to the conversation of ``previous_response_id``."""

    model: str
    response_id: str  # vLLM's ``request_id`` field, else ``resp_<uuid hex>``
    instructions: str | None
    input: tuple[Mapping[str, Any], ...]
    max_output_tokens: int | None
    stream: bool
    store: bool
    previous_response_id: str | None
    ignore_eos: bool = False
    seed: int | None = None
    cache_salt: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    # ``_ECHOED``'s fields as the request gave them (its defaults for the others).
    echoed: Mapping[str, Any] = field(default_factory=lambda: dict(_ECHOED))


def parse_responses(body: Mapping[str, Any], *, served_model_name: str) -> ResponsesCall:
    """The request's fields, checked as vLLM's ``ResponsesRequest`` checks them (no tokenizer)."""
    model = check_model(body, served_model_name)
    if "input" not in body:
        raise bad_request("Field required: 'input'.", "input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string.", "instructions")
    max_output_tokens = optional_int(body, "max_output_tokens")
    if max_output_tokens is not None and max_output_tokens < 1:
        # vLLM's sampling parameters refuse it (the field itself has no bound).
        raise bad_request(f"max_tokens must be at least 1, got {max_output_tokens}.", "max_tokens")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise bad_request("'previous_response_id' must be a string.", "previous_response_id")
    request_id = body.get("request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise bad_request("'request_id' must be a string.", "request_id")
    if body.get("prompt") is not None:
        raise bad_request("prompt template is not supported", "prompt")
    store = optional_bool(body, "store")
    if optional_bool(body, "background"):
        raise bad_request("The simulator does not model background responses.", "background")
    return ResponsesCall(
        model=model,
        response_id=request_id or f"resp_{uuid.uuid4().hex}",
        instructions=instructions,
        input=_input_messages(body["input"]),
        max_output_tokens=max_output_tokens,
        stream=optional_bool(body, "stream") or False,
        store=True if store is None else store,
        previous_response_id=previous,
        ignore_eos=optional_bool(body, "ignore_eos") or False,
        seed=optional_int(body, "seed"),
        cache_salt=cache_salt_of(body),
        temperature=_optional_number(body, "temperature", 1.0),
        top_p=_optional_number(body, "top_p", 1.0),
        echoed={k: body[k] if body.get(k) is not None else v for k, v in _ECHOED.items()},
    )


def previous_not_found(response_id: str) -> ApiError:
    """vLLM's answer to a ``previous_response_id`` its store does not hold."""
    return ApiError(
        404, "invalid_request_error", f"Response with id '{response_id}' not found.", "response_id"
    )


def prompt_fills_context(num_tokens: int, max_model_len: int) -> ApiError:
    """vLLM's Responses check of a rendered prompt that leaves no room to generate."""
    return ApiError(
        400,
        "invalid_request_error",
        f"The engine prompt length {num_tokens} exceeds the max_model_len {max_model_len}. "
        "Please reduce prompt.",
        "input",
    )


def conversation(
    call: ResponsesCall, previous: StoredResponse | None
) -> tuple[Mapping[str, Any], ...]:
    """The chat messages the engine renders for ``call`` (vLLM's ``construct_input_messages``)."""
    messages: list[Mapping[str, Any]] = []
    if call.instructions:
        messages.append({"role": "system", "content": call.instructions})
    if previous is not None:
        messages.extend(m for m in previous.messages if m.get("role") != "system")
        if previous.text:  # an empty output has no content part to replay
            messages.append({"role": "assistant", "content": previous.text})
    messages.extend(call.input)
    return tuple(messages)


def generation_request(
    call: ResponsesCall, messages: Sequence[Mapping[str, Any]]
) -> GenerationRequest:
    """The engine request: a chat of ``messages`` (rendered with the chat template, as vLLM's
    Responses path does), ``max_output_tokens`` its output limit (the rest of the context
    when omitted)."""
    return GenerationRequest(
        kind="chat",
        model=call.model,
        prompt=chat_messages({"messages": list(messages)}),
        max_tokens=call.max_output_tokens,
        n=1,
        stream=call.stream,
        include_usage=False,
        ignore_eos=call.ignore_eos,
        seed=call.seed,
        cache_salt=call.cache_salt,
        max_tokens_param="max_output_tokens",
    )


# -- answers ----------------------------------------------------------------------------------


def usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """vLLM's ``ResponseUsage`` (the cached tokens are always reported on this path)."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def output_message(item_id: str, text: str) -> dict[str, Any]:
    """The answer's output item; no content part when nothing was generated (vLLM's)."""
    parts: list[dict[str, Any]] = [
        {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
    ]
    return {
        "id": item_id,
        "content": parts if text else [],
        "role": "assistant",
        "status": "completed",
        "type": "message",
    }


def response(
    call: ResponsesCall,
    *,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    max_output_tokens: int,
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """vLLM's ``ResponsesResponse.from_request``, in its field order (``usage`` near the end).
    ``status`` ``incomplete`` (the output limit was reached) carries its reason."""
    echoed = call.echoed
    return {
        "id": call.response_id,
        "created_at": created_at,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": call.instructions,
        "metadata": echoed["metadata"],
        "model": call.model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": echoed["parallel_tool_calls"],
        "temperature": call.temperature,
        "tool_choice": echoed["tool_choice"],
        "tools": echoed["tools"],
        "top_p": call.top_p,
        "background": False,
        "max_output_tokens": max_output_tokens,
        "max_tool_calls": echoed["max_tool_calls"],
        "previous_response_id": call.previous_response_id,
        "prompt": None,
        "reasoning": echoed["reasoning"],
        "service_tier": echoed["service_tier"],
        "status": status,
        "text": echoed["text"],
        "top_logprobs": None,
        "truncation": echoed["truncation"],
        "usage": usage,
        "user": echoed["user"],
        "input_messages": None,
        "output_messages": None,
    }


def text_events_opening(item_id: str) -> list[tuple[str, dict[str, Any]]]:
    """The events before the first text delta: the message item and its text part, empty."""
    item = {"id": item_id, "content": [], "role": "assistant", "status": "in_progress"}
    part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
    return [
        ("response.output_item.added", {"item": {**item, "type": "message"}, "output_index": 0}),
        (
            "response.content_part.added",
            {"content_index": 0, "item_id": item_id, "output_index": 0, "part": part},
        ),
    ]


def text_delta(item_id: str, delta: str) -> tuple[str, dict[str, Any]]:
    return (
        "response.output_text.delta",
        {
            "content_index": 0,
            "delta": delta,
            "item_id": item_id,
            "logprobs": [],
            "output_index": 0,
        },
    )


def text_events_closing(item_id: str, text: str) -> list[tuple[str, dict[str, Any]]]:
    """The events after the last text delta: the text, its part and its item, done."""
    part = {"annotations": [], "text": text, "type": "output_text"}
    item = {"id": item_id, "content": [part], "role": "assistant", "status": "completed"}
    where = {"content_index": 0, "item_id": item_id, "output_index": 0}
    return [
        ("response.output_text.done", {**where, "logprobs": [], "text": text}),
        ("response.content_part.done", {**where, "part": part}),
        ("response.output_item.done", {"item": {**item, "type": "message"}, "output_index": 0}),
    ]


def sse_event(event_type: str, fields: Mapping[str, Any], sequence_number: int) -> bytes:
    """One named SSE event as vLLM frames it (``event:`` line, ``data:`` line, blank line)."""
    data = {**fields, "sequence_number": sequence_number, "type": event_type}
    return f"event: {event_type}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


# -- input --------------------------------------------------------------------------------------


def _input_messages(given: object) -> tuple[Mapping[str, Any], ...]:
    """``input`` as chat messages: a string is one user message; message items keep their role
    and content (a string or content parts: ``input_text``, ``output_text``... read as text)."""
    if isinstance(given, str):
        return ({"role": "user", "content": given},)
    if not isinstance(given, list):
        raise bad_request("'input' must be a string or a list of input items.", "input")
    messages: list[Mapping[str, Any]] = []
    for i, item in enumerate(given):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object.", "input")
        kind = item.get("type", "message")
        if kind != "message":
            raise bad_request(
                f"input[{i}]: items of type '{kind}' are not modelled by the simulator "
                "(message items only).",
                "input",
            )
        if not isinstance(item.get("role"), str):
            raise bad_request(f"input[{i}].role must be a string.", "input")
        content = item.get("content")
        if not isinstance(content, str | list):
            raise bad_request(f"input[{i}].content must be a string or a list of parts.", "input")
        messages.append({"role": item["role"], "content": content})
    return tuple(messages)


def _optional_number(body: Mapping[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"'{key}' must be a number.", key)
    return float(value)
