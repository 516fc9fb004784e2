"""``estimate`` / ``estimate:<bytes_per_token>``: no tokenizer, a size-based guess.

A prompt is ``ceil(utf8_bytes / bytes_per_token)`` tokens (default 4, the usual figure for
English on large BPE vocabularies). A chat adds, per message, ``ESTIMATE_TOKENS_PER_MESSAGE``
for the template's markers plus the role's and name's estimate, and ``ESTIMATE_REPLY_PRIMING``
for the assistant priming. It costs about a microsecond; its error depends on the language and on
the tokenizer (see docs/tokens.md for the figures against the bundled tokenizer): use it only
where a wrong count is cheap, or with a ratio measured for the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from gateway.tokens.errors import ChatTemplateError
from gateway.tokens.messages import content_text

DEFAULT_BYTES_PER_TOKEN = 4.0
ESTIMATE_TOKENS_PER_MESSAGE = 4
ESTIMATE_REPLY_PRIMING = 3


class EstimateCounter:
    """Counts ``ceil(bytes / bytes_per_token)``; never fails on text, never blocks."""

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

    async def count_prompt(self, prompt: str) -> int:
        return self.estimate(prompt)

    async def count_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> int:
        total = ESTIMATE_REPLY_PRIMING if add_generation_prompt else 0
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ChatTemplateError(f"messages[{index}] is not an object")
            total += ESTIMATE_TOKENS_PER_MESSAGE
            total += self.estimate(content_text(message.get("content"), index))
            for key in ("role", "name"):
                value = message.get(key)
                if isinstance(value, str):
                    total += self.estimate(value)
        return total
