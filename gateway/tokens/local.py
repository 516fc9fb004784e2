"""Counters that tokenize in-process: ``hf:<dir>`` (exact for that tokenizer) and
``tiktoken:<encoding>`` (exact for prompts, an approximation for chat)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import tiktoken

from gateway.tokens.errors import ChatTemplateError
from gateway.tokens.hf import HfTokenizer
from gateway.tokens.messages import content_text, message_chars
from gateway.tokens.protocol import count_off_loop

TIKTOKEN_TOKENS_PER_MESSAGE = 3
TIKTOKEN_TOKENS_PER_NAME = 1
TIKTOKEN_REPLY_PRIMING = 3


class HfCounter:
    """``hf:<dir>``: the model's own tokenizer; chat requests count the rendered template.

    Exact when ``<dir>`` is the tokenizer the engine serves with (same counts as vLLM's
    ``/tokenize``), up to templates that read the clock (``strftime_now``).
    """

    def __init__(self, tokenizer: HfTokenizer, *, name: str) -> None:
        self.name = name
        self.tokenizer = tokenizer

    def __repr__(self) -> str:
        return f"HfCounter({self.name!r})"

    async def count_prompt(self, prompt: str) -> int:
        return await count_off_loop(lambda: self.tokenizer.count(prompt), len(prompt))

    async def count_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> int:
        return await count_off_loop(
            lambda: self.tokenizer.count_chat(messages, add_generation_prompt),
            message_chars(messages),
        )


class TiktokenCounter:
    """``tiktoken:<encoding>``: an OpenAI encoding, loaded offline.

    Prompts are encoded as plain text (special-token strings count as text, as on OpenAI's
    API). Chat has no template here, so it follows OpenAI's published recipe for its chat
    models: 3 tokens per message, +1 when a ``name`` is given, every field's text encoded,
    +3 for the assistant reply priming. That is an approximation of the real template of the
    model behind the gateway.
    """

    def __init__(self, encoding: tiktoken.Encoding, *, name: str) -> None:
        self.name = name
        self.encoding = encoding

    def __repr__(self) -> str:
        return f"TiktokenCounter({self.name!r})"

    async def count_prompt(self, prompt: str) -> int:
        return await count_off_loop(lambda: self._count(prompt), len(prompt))

    async def count_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> int:
        return await count_off_loop(
            lambda: self._count_chat(messages, add_generation_prompt), message_chars(messages)
        )

    def _count(self, text: str) -> int:
        return len(self.encoding.encode_ordinary(text))

    def _count_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> int:
        total = TIKTOKEN_REPLY_PRIMING if add_generation_prompt else 0
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ChatTemplateError(f"messages[{index}] is not an object")
            total += TIKTOKEN_TOKENS_PER_MESSAGE
            for key, value in message.items():
                total += self._count(_field_text(key, value, index))
                if key == "name":
                    total += TIKTOKEN_TOKENS_PER_NAME
        return total


def _field_text(key: str, value: object, index: int) -> str:
    if key == "content":
        return content_text(value, index)
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    # tool_calls and the like: count their JSON, which is roughly what a template prints.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
