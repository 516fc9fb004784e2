"""The OpenAI request body, checked once at the boundary.

The body is parsed once; the gateway forwards the client's original bytes unchanged, so
this package only reads what admission needs and rejects what no engine would take.

Contract: `parse_body` raises `BadRequest` (400) for every malformed body, whatever it holds —
never another exception. Before anything is counted or reserved it has checked: strict UTF-8,
JSON without NaN/Infinity, nesting at most `max_depth` deep, no lone surrogate in any string
(a tokenizer cannot encode one), and every field the gateway itself reads (per endpoint: see
`generation`, `pooling`, `responses`).
"""

from __future__ import annotations

from gateway.request.body import (
    DEFAULT_MAX_DEPTH,
    MAX_INT,
    MAX_N,
    json_object,
    load_json,
    model_of,
)
from gateway.request.generation import COMPLETIONS_DEFAULT_MAX_TOKENS, parse_generation
from gateway.request.inbound import GENERATING, Inbound, Kind
from gateway.request.pooling import parse_pooling, parse_scoring
from gateway.request.responses import parse_responses

__all__ = [
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "DEFAULT_MAX_DEPTH",
    "GENERATING",
    "MAX_INT",
    "MAX_N",
    "Inbound",
    "Kind",
    "load_json",
    "parse_body",
]


def parse_body(raw: bytes, kind: Kind, *, max_depth: int = DEFAULT_MAX_DEPTH) -> Inbound:
    """Check a body of endpoint `kind`; raise `BadRequest` with the field named."""
    body = json_object(raw, max_depth)
    if kind in ("chat", "completion"):
        return parse_generation(body, kind)
    if kind in ("embeddings", "pooling"):
        return parse_pooling(body, kind)
    if kind in ("score", "rerank"):
        return parse_scoring(body, kind)
    if kind == "responses":
        return parse_responses(body)
    return Inbound(kind, model_of(body), False, 1, 0)
