"""``engine``: the exact count, asked of an engine's ``POST /tokenize`` (one round trip).

vLLM's ``/tokenize`` accepts ``{"model", "prompt"}`` or ``{"model", "messages",
"add_generation_prompt"}`` and answers ``{"count": N, ...}``, chat template included, with the
same defaults as its completion endpoints (special tokens added for prompts, not for chat).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from gateway.tokens.errors import EngineTokenizeError


class EngineCounter:
    """Asks the candidate engines in order; the next one is tried when an engine cannot be
    reached, times out or answers 5xx (``/tokenize`` has no side effects, so retrying is
    safe). An engine's 4xx answer is final: it is about the request, not the engine.
    Raises :class:`EngineTokenizeError` (with ``status`` and ``attempts``) when no engine
    gives a count.
    """

    name = "engine"

    def __init__(
        self,
        *,
        model: str,
        urls: Callable[[], list[str]],
        client: httpx.AsyncClient,
    ) -> None:
        self.model = model
        self._urls = urls
        self._client = client

    def __repr__(self) -> str:
        return f"EngineCounter(model={self.model!r})"

    async def count_prompt(self, prompt: str) -> int:
        return await self._tokenize({"model": self.model, "prompt": prompt})

    async def count_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> int:
        body = {
            "model": self.model,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        return await self._tokenize(body)

    async def _tokenize(self, body: dict[str, Any]) -> int:
        attempts: list[str] = []
        for base in self._urls():
            url = base.rstrip("/") + "/tokenize"
            try:
                response = await self._client.post(url, json=body)
            except httpx.TransportError as exc:
                attempts.append(f"{url}: {type(exc).__name__}: {exc}")
                continue
            if response.status_code >= 500:
                attempts.append(f"{url}: HTTP {response.status_code}")
                continue
            return _count_from(response, url)
        tried = "; ".join(attempts) if attempts else "no engine URL was given"
        raise EngineTokenizeError(
            f"no engine could count tokens for model {self.model!r} ({tried})",
            attempts=tuple(attempts),
        )


def _count_from(response: httpx.Response, url: str) -> int:
    try:
        data = response.json()
    except ValueError:
        data = None
    if response.status_code != 200:
        raise EngineTokenizeError(
            f"{url} answered HTTP {response.status_code}: {_error_message(data, response)}",
            status=response.status_code,
        )
    count = data.get("count") if isinstance(data, dict) else None
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise EngineTokenizeError(f"{url} answered without a valid 'count': {response.text[:200]}")
    return count


def _error_message(data: object, response: httpx.Response) -> str:
    # vLLM: {"error": {"message": ...}}; before mid-2025: {"object": "error", "message": ...}.
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(data.get("message"), str):
            return str(data["message"])
    return response.text[:200]
