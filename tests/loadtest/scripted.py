"""A scripted OpenAI server: refuses with 429 (and the given Retry-After headers) or fails,
as told, and logs when each attempt arrived."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

Decide = Callable[[int], tuple[int, dict[str, str]] | None]
"""attempt number of this request (1, 2, ...) → (status, headers) to refuse, or None."""


class Scripted:
    def __init__(self, decide: Decide) -> None:
        self.decide = decide
        self.arrivals: dict[str, list[float]] = {}
        self.keys: list[str | None] = []
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
            ]
        )

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "max_model_len": 4096}]})

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.keys.append(request.headers.get("authorization"))
        key = json.dumps(body["messages"])
        times = self.arrivals.setdefault(key, [])
        times.append(time.monotonic())
        refusal = self.decide(len(times))
        if refusal is not None:
            status, headers = refusal
            error = {"error": {"message": "no", "type": "x", "code": "queue_full"}}
            return JSONResponse(error, status_code=status, headers=headers)

        async def events():  # type: ignore[no-untyped-def]
            yield _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for word in ("Hi", " there"):
                yield _event({"choices": [{"index": 0, "delta": {"content": word}}]})
            yield _event({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def _event(body: object) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"
