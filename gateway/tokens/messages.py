"""OpenAI chat messages as text, for the counters that have no chat template (``tiktoken:``,
``estimate``), and a cheap size of a chat for the off-loop decision."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from gateway.tokens.chat import (
    MEDIA_PART_TYPES,
    OTHER_PART_TYPES,
    TEXT_PART_TYPES,
    UNCOUNTABLE_PART_TYPES,
    ChatInput,
)
from gateway.tokens.errors import ChatTemplateError


def content_text(content: object, index: int) -> str:
    """The text of ``messages[index].content``, in vLLM's "string" content format.

    ``None`` is ``""``; a string is itself; a list of parts is the texts of its text parts
    (``text``, ``input_text``, ``output_text``, ``refusal``, ``thinking``) joined with
    ``"\\n"``. Media parts add no text here: the caller counts them (``ChatInput.media``). Any
    other part raises :class:`ChatTemplateError` naming the message and part.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatTemplateError(
            f"messages[{index}].content must be a string or a list of parts, "
            f"not {type(content).__name__}"
        )
    texts: list[str] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if isinstance(part, str):
            texts.append(part)
            continue
        if kind in MEDIA_PART_TYPES or kind in UNCOUNTABLE_PART_TYPES:
            continue
        if kind in OTHER_PART_TYPES:
            name = part.get("name") if isinstance(part, Mapping) else None
            if isinstance(name, str):
                texts.append(name)
            continue
        if kind not in TEXT_PART_TYPES:
            shown = kind if isinstance(part, Mapping) else type(part).__name__
            raise ChatTemplateError(
                f"messages[{index}].content[{j}]: unsupported content part type {shown!r}"
            )
        key = "thinking" if kind == "thinking" else "refusal" if kind == "refusal" else "text"
        text = part.get(key)
        if text is None and kind in ("text", "refusal"):
            continue  # vLLM skips these
        if not isinstance(text, str):
            raise ChatTemplateError(f"messages[{index}].content[{j}].{key} must be a string")
        texts.append(text)
    return "\n".join(texts)


def extras_text(chat: ChatInput) -> str:
    """What a template-less counter counts besides the messages: the tools and documents as
    the JSON a template would print (an approximation of the real template's text)."""
    pieces: list[str] = []
    tools = chat.template_variables().get("tools")
    if tools:
        pieces.append(json.dumps(tools, ensure_ascii=False))
    documents = chat.template_kwargs.get("documents")
    if documents:
        pieces.append(json.dumps(documents, ensure_ascii=False))
    return "\n".join(pieces)


def message_chars(messages: Sequence[object]) -> int:
    """A cheap size of a conversation (characters of its text contents), to decide whether
    counting it is worth a worker thread. Never raises, whatever the messages hold."""
    total = 0
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                    total += len(part["text"])
    return total


def chat_chars(chat: ChatInput) -> int:
    """:func:`message_chars`, plus a cheap size of the tools and documents."""
    total = message_chars(chat.messages)
    if chat.tools:
        total += sum(len(str(t)) for t in chat.tools)
    documents = chat.template_kwargs.get("documents")
    if isinstance(documents, list):
        total += sum(len(str(d)) for d in documents)
    return total
