"""Bodies of the endpoints that read prompts and generate nothing: `/v1/embeddings`,
`/pooling`, `/score` (`/v1/score`), `/rerank` (`/v1/rerank`, `/v2/rerank`).

Embeddings and pooling take `input` (the completions prompt forms) or `messages` (one chat,
rendered with the chat template; `add_generation_prompt` defaults to false there, as vLLM's).
Score pairs `queries`/`text_1`/`data_1` with `documents`/`items`/`text_2`/`data_2` (one query
for every document, or one each, in order); rerank pairs its `query` with each of its
`documents`. Score and rerank inputs must be text here: the gateway cannot count a media
document (400).
"""

from __future__ import annotations

from typing import Any

from gateway.request.body import bad, model_of
from gateway.request.generation import check_messages, check_prompt
from gateway.request.inbound import Inbound, Kind
from gateway.tokens.chat import chat_input
from gateway.tokens.errors import InvalidChatRequest

SCORE_FIELDS = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)


def parse_pooling(body: dict[str, Any], kind: Kind) -> Inbound:
    """An embeddings or pooling body; raise `BadRequest` with the field named."""
    model = model_of(body)
    if "messages" in body:
        messages = check_messages(body["messages"])
        defaults = {"add_generation_prompt": False, **body}
        try:
            chat = chat_input(defaults, messages)
        except InvalidChatRequest as e:
            raise bad(str(e), e.param) from None
        return Inbound(kind, model, False, 1, 0, messages=messages, chat=chat)
    if "input" not in body:
        raise bad("you must provide an 'input' (or 'messages')", "input")
    prompt = body["input"]
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        # vLLM's chat-style input: `input` holding messages.
        return parse_pooling({**body, "messages": prompt}, kind)
    return Inbound(kind, model, False, 1, 0, prompt=check_prompt(prompt, "input"))


def parse_scoring(body: dict[str, Any], kind: Kind) -> Inbound:
    """A score or rerank body: its (query, document) pairs."""
    model = model_of(body)
    if kind == "rerank":
        query = _text(body.get("query"), "query")
        documents = _texts(body.get("documents"), "documents")
        queries = [query]
    else:
        for first, second in SCORE_FIELDS:
            if first in body and second in body:
                queries = _texts(body[first], first)
                documents = _texts(body[second], second)
                break
        else:
            raise bad("you must provide 'queries' and 'documents' (or 'text_1' and 'text_2')")
        if len(queries) != 1 and len(queries) != len(documents):
            raise bad(
                f"{len(queries)} queries for {len(documents)} documents: give one query, or "
                "one per document"
            )
    if not documents:
        raise bad("'documents' must not be empty", "documents")
    if len(queries) == 1:
        pairs = tuple((queries[0], d) for d in documents)
    else:
        pairs = tuple(zip(queries, documents, strict=True))
    return Inbound(kind, model, False, 1, 0, pairs=pairs, queries=tuple(dict.fromkeys(queries)))


def _text(value: object, param: str) -> str:
    if isinstance(value, str):
        return value
    raise bad(f"'{param}' must be a string (the gateway counts text inputs only)", param)


def _texts(value: object, param: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise bad(
        f"'{param}' must be a string or a list of strings (the gateway counts text inputs only)",
        param,
    )
