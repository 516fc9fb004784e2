"""``estimate`` / ``estimate:<bytes_per_token>``: no tokenizer, a size-based guess.

A prompt is ``ceil(utf8_bytes / bytes_per_token)`` tokens (default 4, the usual figure for
English on large BPE vocabularies). A chat adds, per message, ``ESTIMATE_TOKENS_PER_MESSAGE``
for the template's markers plus the role's and name's estimate, and ``ESTIMATE_REPLY_PRIMING``
for the assistant priming. It costs about a microsecond; its error depends on the language and on
the tokenizer (see docs/tokens.md for the figures against the bundled tokenizer): use it only
where a wrong count is cheap, or with a ratio measured for the model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

from gateway.tokens.chat import ChatInput
from gateway.tokens.count import TokenCount
from gateway.tokens.errors import ChatTemplateError
from gateway.tokens.local import media_tokens
from gateway.tokens.messages import content_text, extras_text

DEFAULT_BYTES_PER_TOKEN = 4.0
ESTIMATE_TOKENS_PER_MESSAGE = 4
ESTIMATE_REPLY_PRIMING = 3


class EstimateCounter:
    """Counts ``ceil(bytes / bytes_per_token)``; never fails on text, never blocks. Tools and
    documents count as their JSON, media parts as ``chat.media``; it gives no token ids."""

    gives_ids = False

    def __init__(self, bytes_per_token: float = DEFAULT_BYTES_PER_TOKEN, *, name: str) -> None:
        if not (math.isfinite(bytes_per_token) and bytes_per_token > 0):
            raise ValueError(f"bytes_per_token must be a positive number, got {bytes_per_token}")
        self.name = name
        self.bytes_per_token = bytes_per_token

    def __repr__(self) -> str:
        return f"EstimateCounter({self.name!r})"

    def estimate(self, text: str) -> int:
        size = len(text) if text.isascii() else len(text.encode("utf-8"))
        return math.ceil(size / self.bytes_per_token)

    async def count_prompt(self, prompt: str) -> TokenCount:
        return TokenCount(self.estimate(prompt))

    async def count_chat(self, chat: ChatInput) -> TokenCount:
        total = ESTIMATE_REPLY_PRIMING if chat.add_generation_prompt else 0
        for index, message in enumerate(chat.messages):
            if not isinstance(message, Mapping):
                raise ChatTemplateError(f"messages[{index}] is not an object")
            total += ESTIMATE_TOKENS_PER_MESSAGE
            total += self.estimate(content_text(message.get("content"), index))
            for key in ("role", "name"):
                value = message.get(key)
                if isinstance(value, str):
                    total += self.estimate(value)
            calls = message.get("tool_calls")
            if calls:
                total += self.estimate(json.dumps(calls, ensure_ascii=False))
        extras = extras_text(chat)
        if extras:
            total += self.estimate(extras)
        return TokenCount(total + media_tokens(chat))
