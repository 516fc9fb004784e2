"""The OpenAI request body, checked once at the boundary.

The body is parsed once; the gateway forwards the client's original bytes unchanged, so
this module only reads what admission needs and rejects what no engine would take.

Contract: `parse_body` raises `BadRequest` (400) for every malformed body, whatever it holds —
never another exception. Before anything is counted or reserved it has checked: strict UTF-8,
JSON without NaN/Infinity, nesting at most `max_depth` deep, no lone surrogate in any string
(a tokenizer cannot encode one), and every field the gateway itself reads (`model`, `stream`,
`stream_options`, `n`, `max_tokens`, `max_completion_tokens`, `messages`, `prompt`). Fields
it does not read pass through to the engine unchecked: vLLM has many extensions.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from gateway.errors import BadRequest

Kind = Literal["chat", "completion"]

MAX_N = 128
MAX_INT = 2**31 - 1
"""Largest integer accepted in a field the gateway reads: far beyond any context length, and
small enough that no arithmetic on it (token buckets are floats) can overflow."""
DEFAULT_MAX_DEPTH = 64
"""Default nesting limit of a body: chat bodies nest ~6 deep, tool JSON schemas ~20."""
# A `\uD800`-`\uDFFF` escape: the only way a lone surrogate gets into a body that is valid
# UTF-8. Found, the decoded body is checked exactly (escaped pairs are fine).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
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


def _int_field(
    body: dict[str, Any], name: str, *, minimum: int, maximum: int = MAX_INT
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer, got {_shown(value)}", name)
    if value < minimum:
        raise _bad(f"'{name}' must be at least {minimum}, got {value}", name)
    if value > maximum:
        raise _bad(f"'{name}' must be at most {maximum}, got {_shown(value)}", name)
    return value


def _shown(value: Any) -> str:
    """A client's value for an error message, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:40] + "…"


def _refuse_constant(name: str) -> Any:
    raise _bad(f"request body is not valid JSON: {name} is not a JSON number")


def load_json(raw: bytes, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """The body as JSON, checked for what would break the gateway or an engine later: strict
    UTF-8 (no encoded surrogates, no UTF-16), no NaN/Infinity, nesting at most `max_depth`
    deep (`[]` and `{}` count one level each), no lone surrogate in any string or key."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:  # deeper than the interpreter's own limit (~1,000 levels)
        raise _bad(f"request body nests deeper than {max_depth} levels") from None
    except ValueError as e:
        raise _bad(f"request body is not valid JSON: {e}") from None
    # Cheap tests first (C speed over the text): a typical body skips the walks.
    if text.count("[") + text.count("{") > max_depth and _deeper_than(value, max_depth):
        raise _bad(f"request body nests deeper than {max_depth} levels")
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise _bad(
                "request body holds invalid Unicode: a lone surrogate escape (\\ud800-\\udfff)"
            ) from None
    return value


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether containers nest more than `limit` levels deep (iteratively: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


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
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise _bad(
                    f"messages[{i}].content[{j}] must be an object with a 'type'", "messages"
                )
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content[{j}].text must be a string", "messages")
    return messages


def _check_prompt(prompt: Any) -> Any:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return prompt
        if all(_is_token_id(p) for p in prompt):
            return prompt
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
            return prompt
    raise _bad(
        "'prompt' must be a string, a list of strings, a list of token ids (integers from 0 "
        f"to {MAX_INT}) or a list of lists of token ids (none empty)",
        "prompt",
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT


def parse_body(raw: bytes, kind: Kind, *, max_depth: int = DEFAULT_MAX_DEPTH) -> Inbound:
    """Check an OpenAI chat or completions body; raise `BadRequest` with the field named."""
    body = load_json(raw, max_depth)
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
    n = _int_field(body, "n", minimum=1, maximum=MAX_N) or 1
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    if options and not stream:
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
