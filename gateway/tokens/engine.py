"""``engine``: the exact count, asked of an engine's ``POST /tokenize`` (one round trip).

vLLM's ``/tokenize`` accepts ``{"model", "prompt"}`` or a chat (``TokenizeChatRequest``:
``messages``, ``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens``,
``tools``, ``chat_template``, ``chat_template_kwargs``, ``mm_processor_kwargs``; no
``tool_choice`` and no ``documents`` — those travel in ``chat_template_kwargs``) and answers
``{"count": N, "tokens": [...], ...}``, chat template included, with the same defaults as its
completion endpoints (special tokens added for prompts, not for chat). vLLM 0.32 runs the
multimodal processor there too (``vllm/entrypoints/serve/tokenize/serving.py`` renders through
``process_for_engine``), so an image's placeholder comes back expanded into its tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import aiohttp

from gateway.tokens.chat import ChatInput
from gateway.tokens.count import TokenCount
from gateway.tokens.errors import EngineTokenizeError
from gateway.tokens.local import media_tokens


class EngineCounter:
    """Asks the candidate engines in order; the next one is tried when an engine cannot be
    reached, times out or answers 5xx (``/tokenize`` has no side effects, so retrying is
    safe). An engine's 4xx answer is final: it is about the request, not the engine.
    Raises :class:`EngineTokenizeError` (with ``status`` and ``attempts``) when no engine
    gives a count.

    ``client`` is an aiohttp session (the gateway's data-plane session: a count is on every
    request's path); ``timeout`` applies to each ``/tokenize`` call. ``expands_media``: the
    engine's ``/tokenize`` counts media parts (vLLM 0.32 does); otherwise the gateway adds
    ``chat.media``'s tokens to its answer. Counts carry the engine's token ids (text prompts).
    """

    name = "engine"
    gives_ids = True

    def __init__(
        self,
        *,
        model: str,
        urls: Callable[[], list[str]],
        client: aiohttp.ClientSession,
        timeout: aiohttp.ClientTimeout | None = None,
        expands_media: bool = True,
    ) -> None:
        self.model = model
        self.expands_media = expands_media
        self._urls = urls
        self._client = client
        self._timeout = timeout

    def __repr__(self) -> str:
        return f"EngineCounter(model={self.model!r})"

    async def count_prompt(self, prompt: str) -> TokenCount:
        return await self._tokenize({"model": self.model, "prompt": prompt})

    async def count_chat(self, chat: ChatInput) -> TokenCount:
        counted = await self._tokenize(chat.tokenize_body(self.model, chat.messages))
        if not chat.media_parts:
            return counted
        if self.expands_media:
            return TokenCount(counted.count)  # media prompts carry no ids (see TokenCount)
        return TokenCount(counted.count + media_tokens(chat))

    async def _tokenize(self, body: dict[str, Any]) -> TokenCount:
        attempts: list[str] = []
        data = json.dumps(body).encode()
        headers = {"content-type": "application/json"}
        for base in self._urls():
            url = base.rstrip("/") + "/tokenize"
            kwargs: dict[str, Any] = {"data": data, "headers": headers}
            if self._timeout is not None:
                kwargs["timeout"] = self._timeout
            try:
                async with self._client.post(url, **kwargs) as response:
                    status, text = response.status, await response.text(errors="replace")
            except (aiohttp.ClientError, TimeoutError) as exc:
                attempts.append(f"{url}: {type(exc).__name__}: {exc}")
                continue
            if status >= 500:
                attempts.append(f"{url}: HTTP {status}")
                continue
            return _count_from(status, text, url)
        tried = "; ".join(attempts) if attempts else "no engine URL was given"
        raise EngineTokenizeError(
            f"no engine could count tokens for model {self.model!r} ({tried})",
            attempts=tuple(attempts),
        )


def _count_from(status: int, text: str, url: str) -> TokenCount:
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if status != 200:
        detail = _error_message(data, text)
        raise EngineTokenizeError(
            f"{url} answered HTTP {status}: {detail}", status=status, detail=detail
        )
    count = data.get("count") if isinstance(data, dict) else None
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise EngineTokenizeError(f"{url} answered without a valid 'count': {text[:200]}")
    tokens = data.get("tokens")
    if isinstance(tokens, list) and len(tokens) == count:
        return TokenCount(count, tokens)
    return TokenCount(count)


def _error_message(data: object, text: str) -> str:
    # vLLM: {"error": {"message": ...}}; before mid-2025: {"object": "error", "message": ...}.
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(data.get("message"), str):
            return str(data["message"])
    return text[:200]
