"""Checks every OpenAI body gets, whatever its endpoint: strict UTF-8, JSON without
NaN/Infinity, bounded nesting, no lone surrogate, and the integer fields the gateway reads."""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.errors import BadRequest

MAX_N = 128
MAX_INT = 2**31 - 1
"""Largest integer accepted in a field the gateway reads: far beyond any context length, and
small enough that no arithmetic on it (token buckets are floats) can overflow."""
DEFAULT_MAX_DEPTH = 64
"""Default nesting limit of a body: chat bodies nest ~6 deep, tool JSON schemas ~20."""
# A `\uD800`-`\uDFFF` escape: the only way a lone surrogate gets into a body that is valid
# UTF-8. Found, the decoded body is checked exactly (escaped pairs are fine).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def bad(message: str, param: str | None = None) -> BadRequest:
    return BadRequest(message, param=param)


def int_field(
    body: dict[str, Any], name: str, *, minimum: int, maximum: int = MAX_INT
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer, got {shown(value)}", name)
    if value < minimum:
        raise bad(f"'{name}' must be at least {minimum}, got {value}", name)
    if value > maximum:
        raise bad(f"'{name}' must be at most {maximum}, got {shown(value)}", name)
    return value


def shown(value: Any) -> str:
    """A client's value for an error message, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:40] + "…"


def _refuse_constant(name: str) -> Any:
    raise bad(f"request body is not valid JSON: {name} is not a JSON number")


def load_json(raw: bytes, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """The body as JSON, checked for what would break the gateway or an engine later: strict
    UTF-8 (no encoded surrogates, no UTF-16), no NaN/Infinity, nesting at most `max_depth`
    deep (`[]` and `{}` count one level each), no lone surrogate in any string or key."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:  # deeper than the interpreter's own limit (~1,000 levels)
        raise bad(f"request body nests deeper than {max_depth} levels") from None
    except ValueError as e:
        raise bad(f"request body is not valid JSON: {e}") from None
    # Cheap tests first (C speed over the text): a typical body skips the walks.
    if text.count("[") + text.count("{") > max_depth and _deeper_than(value, max_depth):
        raise bad(f"request body nests deeper than {max_depth} levels")
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad(
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


def json_object(raw: bytes, max_depth: int) -> dict[str, Any]:
    """`load_json`, and the body must be an object."""
    body = load_json(raw, max_depth)
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object")
    return body


def model_of(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("you must provide a 'model' (a string)", "model")
    return model


def stream_of(body: dict[str, Any]) -> bool:
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    return stream
