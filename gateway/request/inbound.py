"""`Inbound`: what admission needs to know about a request, whatever its endpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from gateway.core.types import ServiceClass
from gateway.tokens.chat import ChatInput

Kind = Literal[
    "chat",
    "completion",
    "embeddings",
    "pooling",
    "score",
    "rerank",
    "responses",
    "tokenize",
    "detokenize",
]
GENERATING: frozenset[Kind] = frozenset({"chat", "completion", "responses"})
"""Kinds whose sequences generate output tokens (the others only read their prompts)."""


@dataclass(frozen=True, slots=True)
class Inbound:
    """What admission needs to know about a request.

    Exactly one prompt form is set: `chat` (chat completions, chat-form embeddings, the
    Responses API's input as messages), `prompt` (completions and input-form embeddings:
    str | list[str] | list[int] | list[list[int]]), or `pairs` (score and rerank: one text
    pair per sequence). `tokenize`/`detokenize` set none: they hold no KV.
    `previous_response_id` (Responses API) names the stored response the engine prepends.
    `service_class`: the latency contract admission holds the request to (None: no targets),
    set by the HTTP edge from the tenant and the class header, never from the body.
    """

    kind: Kind
    model: str
    stream: bool
    n: int
    max_output_tokens: int | None
    messages: list[dict[str, Any]] | None = None
    prompt: Any = None
    # The engine's own limit when `max_output_tokens` is None (see RequestShape).
    default_output_tokens: int | None = None
    chat: ChatInput | None = None
    pairs: tuple[tuple[str, str], ...] = ()
    queries: tuple[str, ...] = ()
    previous_response_id: str | None = None
    # What vLLM mixes into the hash of a prompt's first block besides the model: the
    # request's `cache_salt` (empty: none). None: the request reads nothing from the prefix
    # cache (`prompt_logprobs` set: vLLM v1 skips the cache for it) or is not a generation.
    prefix_salt: bytes | None = None
    service_class: ServiceClass | None = None

    @property
    def generates(self) -> bool:
        return self.kind in GENERATING

    @property
    def counted(self) -> bool:
        """Whether the request has a prompt to count (tokenize/detokenize have none)."""
        return self.kind not in ("tokenize", "detokenize")
