"""OpenAI chat messages as text, the one way every counter reads them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gateway.tokens.errors import ChatTemplateError


def content_text(content: object, index: int) -> str:
    """The text of ``messages[index].content``, in vLLM's "string" content format.

    ``None`` is ``""``; a string is itself; a list of ``{"type": "text", "text": ...}`` parts is
    the texts joined with ``"\\n"`` (what vLLM passes to templates that treat content as a
    string). Any other part type cannot be counted by a text tokenizer and raises
    :class:`ChatTemplateError` naming the message and part.
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
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ChatTemplateError(
                f"messages[{index}].content[{j}]: only text parts can be counted, got {kind!r}"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError(f"messages[{index}].content[{j}].text must be a string")
        texts.append(text)
    return "\n".join(texts)


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
