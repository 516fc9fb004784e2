"""The OpenAI request body, checked once at the boundary.

The body is parsed once; the gateway forwards the client's original bytes unchanged, so
this module only reads what admission needs and rejects what no engine would take.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from gateway.errors import BadRequest

Kind = Literal["chat", "completion"]

MAX_N = 128
# vLLM's `/v1/completions` generates 16 tokens when `max_tokens` is left out (OpenAI's legacy
# default); `"max_tokens": null` means up to the context's end, as for chat.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Inbound:
    """What admission needs to know about a request."""

    kind: Kind
    model: str
    stream: bool
    n: int
    max_output_tokens: int | None
    messages: list[dict[str, Any]] | None = None
    prompt: Any = None  # str | list[str] | list[int] | list[list[int]], checked below
    # The engine's own limit when `max_output_tokens` is None (see RequestShape).
    default_output_tokens: int | None = None


def _bad(message: str, param: str | None = None) -> BadRequest:
    return BadRequest(message, param=param)


def _int_field(body: dict[str, Any], name: str, *, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer, got {json.dumps(value)}", name)
    if value < minimum:
        raise _bad(f"'{name}' must be at least {minimum}, got {value}", name)
    return value


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of message objects", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        if not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}].role must be a string", "messages")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise _bad(f"messages[{i}].content must be a string or a list of parts", "messages")
    return messages


def _check_prompt(prompt: Any) -> Any:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return prompt
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return prompt
        if all(
            isinstance(p, list)
            and p
            and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            for p in prompt
        ):
            return prompt
    raise _bad(
        "'prompt' must be a string, a list of strings, a list of token ids "
        "or a list of lists of token ids (none empty)",
        "prompt",
    )


def parse_body(raw: bytes, kind: Kind) -> Inbound:
    """Check an OpenAI chat or completions body; raise `BadRequest` with the field named."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("you must provide a 'model' (a string)", "model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    n = _int_field(body, "n", minimum=1) or 1
    if n > MAX_N:
        raise _bad(f"'n' must be at most {MAX_N}, got {n}", "n")
    if body.get("stream_options") and not stream:
        # vLLM refuses it too (400); caught here, it costs no reservation.
        raise _bad("Stream options can only be defined when `stream=True`.", "stream_options")
    if kind == "chat":
        max_out = _int_field(body, "max_completion_tokens", minimum=1)
        if max_out is None:
            max_out = _int_field(body, "max_tokens", minimum=1)
        return Inbound(
            kind, model, stream, n, max_out, messages=_check_messages(body.get("messages"))
        )
    if "prompt" not in body:
        raise _bad("you must provide a 'prompt'", "prompt")
    # vLLM 0.32's completions read `max_tokens` only; other versions may honour
    # `max_completion_tokens` there too: the larger of the two is reserved.
    fields = ("max_tokens", "max_completion_tokens")
    max_out = max(
        (v for v in (_int_field(body, f, minimum=1) for f in fields) if v is not None),
        default=None,
    )
    default = (
        COMPLETIONS_DEFAULT_MAX_TOKENS if max_out is None and "max_tokens" not in body else None
    )
    return Inbound(
        kind,
        model,
        stream,
        n,
        max_out,
        prompt=_check_prompt(body["prompt"]),
        default_output_tokens=default,
    )
