"""Counters that tokenize in-process: ``hf:<dir>`` (exact for that tokenizer) and
``tiktoken:<encoding>`` (exact for prompts, an approximation for chat)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import tiktoken

from gateway.tokens.chat import ChatInput, MediaTemplate
from gateway.tokens.count import TokenCount
from gateway.tokens.errors import ChatTemplateError
from gateway.tokens.hf import HfTokenizer
from gateway.tokens.messages import chat_chars, content_text, extras_text
from gateway.tokens.protocol import count_off_loop

TIKTOKEN_TOKENS_PER_MESSAGE = 3
TIKTOKEN_TOKENS_PER_NAME = 1
TIKTOKEN_REPLY_PRIMING = 3


def media_tokens(chat: ChatInput) -> int:
    """The tokens of a chat's media parts, as counted (``chat.media``); raises when some part
    was not counted (the service counts them before asking the counter)."""
    if len(chat.media) != chat.media_parts:
        raise ChatTemplateError(
            f"{chat.media_parts} media part(s) but {len(chat.media)} counted: media must be "
            "counted before the chat"
        )
    return sum(item.tokens for item in chat.media)


class HfCounter:
    """``hf:<dir>``: the model's own tokenizer; chat requests count the rendered template.

    Exact when ``<dir>`` is the tokenizer the engine serves with (same counts as vLLM's
    ``/tokenize``), up to templates that read the clock (``strftime_now``). ``defaults`` are
    the engines' ``--default-chat-template-kwargs``; ``media`` where media parts go in the
    prompt (see :class:`MediaTemplate`). Text prompts carry their token ids.
    """

    gives_ids = True

    def __init__(
        self,
        tokenizer: HfTokenizer,
        *,
        name: str,
        defaults: Mapping[str, Any] | None = None,
        media: MediaTemplate | None = None,
    ) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.defaults = dict(defaults or {})
        self.media = media or MediaTemplate()
        self._pad_ids = {
            modality: token_id
            for modality, token in self.media.pad_tokens.items()
            if (token_id := tokenizer.token_to_id(token)) is not None
        }

    def __repr__(self) -> str:
        return f"HfCounter({self.name!r})"

    async def count_prompt(self, prompt: str) -> TokenCount:
        return await count_off_loop(lambda: self._count(prompt), len(prompt))

    async def count_chat(self, chat: ChatInput) -> TokenCount:
        return await count_off_loop(lambda: self._count_chat(chat), chat_chars(chat))

    def _count(self, prompt: str) -> TokenCount:
        encoding = self.tokenizer.encoding(prompt)
        return TokenCount(len(encoding), lambda: encoding.ids)

    def _count_chat(self, chat: ChatInput) -> TokenCount:
        placeholders = self.media.placeholders if chat.media_parts else None
        encoding = self.tokenizer.chat_encoding(
            chat, defaults=self.defaults, placeholders=placeholders
        )
        count = len(encoding)
        if not chat.media_parts:
            return TokenCount(count, lambda: encoding.ids)
        total = media_tokens(chat)
        ids: list[int] = encoding.ids
        for modality, pad_id in self._pad_ids.items():
            items = [m for m in chat.media if m.modality == modality]
            # Each item's placeholder holds one pad token, which the processor replaces by the
            # item's tokens; a template that wrote them otherwise gets no such credit.
            if items and ids.count(pad_id) == len(items):
                total -= len(items)
        # No ids: vLLM's cache blocks of a media prompt are keyed by the media's hashes too.
        return TokenCount(count + total)


class TiktokenCounter:
    """``tiktoken:<encoding>``: an OpenAI encoding, loaded offline.

    Prompts are encoded as plain text (special-token strings count as text, as on OpenAI's
    API). Chat has no template here, so it follows OpenAI's published recipe for its chat
    models: 3 tokens per message, +1 when a ``name`` is given, every field's text encoded,
    +3 for the assistant reply priming; tools and documents count as their JSON, media parts
    as ``chat.media``. That is an approximation of the real template of the model behind the
    gateway. Its ids are not the model's: it gives none.
    """

    gives_ids = False

    def __init__(self, encoding: tiktoken.Encoding, *, name: str) -> None:
        self.name = name
        self.encoding = encoding

    def __repr__(self) -> str:
        return f"TiktokenCounter({self.name!r})"

    async def count_prompt(self, prompt: str) -> TokenCount:
        return await count_off_loop(lambda: TokenCount(self._count(prompt)), len(prompt))

    async def count_chat(self, chat: ChatInput) -> TokenCount:
        return await count_off_loop(lambda: TokenCount(self._count_chat(chat)), chat_chars(chat))

    def _count(self, text: str) -> int:
        return len(self.encoding.encode_ordinary(text))

    def _count_chat(self, chat: ChatInput) -> int:
        total = TIKTOKEN_REPLY_PRIMING if chat.add_generation_prompt else 0
        for index, message in enumerate(chat.messages):
            if not isinstance(message, Mapping):
                raise ChatTemplateError(f"messages[{index}] is not an object")
            total += TIKTOKEN_TOKENS_PER_MESSAGE
            for key, value in message.items():
                total += self._count(_field_text(key, value, index))
                if key == "name":
                    total += TIKTOKEN_TOKENS_PER_NAME
        extras = extras_text(chat)
        if extras:
            total += self._count(extras)
        return total + media_tokens(chat)


def _field_text(key: str, value: object, index: int) -> str:
    if key == "content":
        return content_text(value, index)
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    # tool_calls and the like: count their JSON, which is roughly what a template prints.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
