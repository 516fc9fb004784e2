"""Fixtures for token counting tests: the bundled tokenizer and a real tiny /tokenize server."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.tokens import HfTokenizer, bundled_tokenizer_path
from gateway.tokens.chat import chat_input

MODEL = "tiny"


@pytest.fixture(scope="session")
def tiny() -> HfTokenizer:
    return HfTokenizer.load(bundled_tokenizer_path())


@dataclass
class TokenizeServer:
    """A vLLM-shaped ``POST /tokenize`` over a real socket; ``fail_with`` makes it answer
    that status to everything (a dead engine)."""

    url: str = ""
    hits: int = 0
    fail_with: int | None = None
    answer: tuple[int, str] | None = None  # (status, body) to answer everything with
    gzip: bool = False  # answer gzip-compressed, as a proxy in front of an engine may
    bodies: list[dict[str, Any]] = field(default_factory=list)


def _tokenize_app(tok: HfTokenizer, state: TokenizeServer) -> Starlette:
    def error(status: int, kind: str, message: str) -> JSONResponse:
        body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
        return JSONResponse(body, status_code=status)

    async def tokenize(request: Request) -> Response:
        state.hits += 1
        if state.answer is not None:  # a misbehaving engine
            status, text = state.answer
            return Response(text, status_code=status, media_type="application/json")
        if state.fail_with is not None:
            return error(state.fail_with, "InternalServerError", "engine is dead")
        body = await request.json()
        state.bodies.append(body)
        if body.get("model") != MODEL:
            return error(404, "NotFoundError", f"The model `{body.get('model')}` does not exist.")
        if "messages" in body:
            chat = chat_input(body, body["messages"])
            ids = tok.encode(tok.render_chat(chat), add_special_tokens=chat.add_special_tokens)
        else:
            ids = tok.encode(body["prompt"])
        answer = {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None}
        if state.gzip:
            packed = gzip.compress(json.dumps(answer).encode())
            headers = {"content-encoding": "gzip"}
            return Response(packed, media_type="application/json", headers=headers)
        return JSONResponse(answer)

    return Starlette(routes=[Route("/tokenize", tokenize, methods=["POST"])])


async def _serve(tok: HfTokenizer) -> AsyncIterator[TokenizeServer]:
    state = TokenizeServer()
    config = uvicorn.Config(
        _tokenize_app(tok, state), host="127.0.0.1", port=0, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    state.url = f"http://127.0.0.1:{port}"
    try:
        yield state
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def engine_a(tiny: HfTokenizer) -> AsyncIterator[TokenizeServer]:
    async for state in _serve(tiny):
        yield state


@pytest.fixture
async def engine_b(tiny: HfTokenizer) -> AsyncIterator[TokenizeServer]:
    async for state in _serve(tiny):
        yield state


@pytest.fixture
def closed_url() -> str:
    """A URL on which nothing listens (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as c:
        yield c
