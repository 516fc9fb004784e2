"""The tool's HTTP client: one pooled aiohttp session, one attempt at a time.

aiohttp because the client's own CPU bounds what a small machine can send: the gateway's
benchmarks measured a pooled httpx client at 1.2–10 ms of CPU per request, several times
aiohttp's. Streams are read line by line; each event carrying a token is timestamped (a
chat stream's opening role-only event is not a token, as vLLM does not count it either).
`stream_options.include_usage` is always asked for, so token counts are the engine's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from gateway.loadtest.prompts import Built

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
RETRY_HEADERS = ("retry-after", "retry-after-ms")


@dataclass(slots=True)
class Answer:
    """What one attempt got back (times from `time.perf_counter`)."""

    status: int
    started: float
    answered: float
    finished: float
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    text: str = ""


def request_body(
    api: str,
    built: Built,
    *,
    model: str,
    max_tokens: int,
    stream: bool,
    ignore_eos: bool,
) -> bytes:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens}
    if api == "chat":
        body["messages"] = built.messages
    else:
        body["prompt"] = built.prompt
    if ignore_eos:
        body["ignore_eos"] = True
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body, separators=(",", ":")).encode()


KEEPALIVE_S = 2.0


class Client:
    """Sends attempts to one of `base_urls` (round robin when there are several: a client
    spreading its load over engines itself).

    `targets` (`compare --order mixed`): several targets' URLs by name, in place of
    `base_urls`; requests go to the targets in turn, and within a target round robin over
    its URLs, so that every target gets the same share of the same load at the same time."""

    def __init__(
        self,
        base_urls: list[str] | None = None,
        *,
        targets: Mapping[str, Sequence[str]] | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        if (base_urls is None) == (targets is None):
            raise ValueError("give either base_urls or targets")
        groups = (
            {None: base_urls or []}
            if targets is None
            else {name: list(urls) for name, urls in targets.items()}
        )
        self._groups: list[tuple[str | None, list[str]]] = [
            (name, [u.rstrip("/") for u in urls]) for name, urls in groups.items()
        ]
        if not self._groups or not all(urls for _, urls in self._groups):
            raise ValueError("every target needs a URL")
        self.base_urls = [u for _, urls in self._groups for u in urls]
        self._names = {u: name for name, urls in self._groups for u in urls}
        self._next = 0
        self._next_in: list[int] = [0] * len(self._groups)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        # Idle connections are dropped after KEEPALIVE_S, before the server's own keep-alive
        # (uvicorn's, vLLM's: 5 s; aiohttp keeps them 15 s by default) closes one under the
        # next request: that race counts as an error of the target (ServerDisconnectedError,
        # seen against vLLM in the e2e sweep).
        connector = aiohttp.TCPConnector(
            limit=0, force_close=False, enable_cleanup_closed=True, keepalive_timeout=KEEPALIVE_S
        )
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def pick(self) -> str:
        # The k-th pick goes to target (k + k // n) % n: every n picks each target once, and
        # the order shifts by one every cycle, so that n clients taking turns do not each
        # stay with one target (with 2 targets: a b b a a b b a ...).
        n, k = len(self._groups), self._next
        group = (k + k // n) % n
        self._next += 1
        urls = self._groups[group][1]
        url = urls[self._next_in[group] % len(urls)]
        self._next_in[group] += 1
        return url

    def target_of(self, url: str) -> str | None:
        """The target name `url` belongs to (None for a client of one target)."""
        return self._names.get(url)

    async def send(
        self, api: str, body: bytes, *, stream: bool, api_key: str | None, base_url: str
    ) -> Answer:
        assert self._session is not None, "use `async with Client(...)`"
        headers = {"content-type": "application/json"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        started = time.perf_counter()
        answer = Answer(0, started, started, started)
        try:
            async with self._session.post(
                base_url + PATHS[api], data=body, headers=headers
            ) as response:
                answer.status = response.status
                answer.answered = time.perf_counter()
                if response.status != 200:
                    answer.headers = _retry_headers(response.headers)
                    answer.code = _error_code(await response.read())
                elif stream:
                    await _read_stream(response, answer, api)
                else:
                    _read_whole(await response.read(), answer, api)
        except TimeoutError:
            answer.code = "timeout"
        except aiohttp.ClientConnectorError:
            answer.code = "connect"
        except aiohttp.ClientError as exc:
            answer.code = type(exc).__name__
        except ValueError:
            answer.code = "bad_response"
        answer.finished = time.perf_counter()
        if answer.status == 0:
            answer.answered = answer.finished
        return answer


def _retry_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: headers[k] for k in RETRY_HEADERS if k in headers}


def _error_code(raw: bytes) -> str | None:
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        code = error.get("code") or error.get("type")
        return None if code is None else str(code)
    return None


async def _read_stream(response: aiohttp.ClientResponse, answer: Answer, api: str) -> None:
    pieces: list[str] = []
    key = "delta" if api == "chat" else None
    async for line in response.content:
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        now = time.perf_counter()
        event = json.loads(payload)
        choices = event.get("choices")
        if choices:
            choice = choices[0]
            text = (choice.get(key) or {}).get("content") if key else choice.get("text")
            if text or choice.get("finish_reason"):
                answer.token_times.append(now)
                pieces.append(text or "")
        usage = event.get("usage")
        if usage:
            answer.prompt_tokens = usage.get("prompt_tokens")
            answer.completion_tokens = usage.get("completion_tokens")
    answer.text = "".join(pieces)


def _read_whole(raw: bytes, answer: Answer, api: str) -> None:
    body = json.loads(raw)
    usage = body.get("usage") or {}
    answer.prompt_tokens = usage.get("prompt_tokens")
    answer.completion_tokens = usage.get("completion_tokens")
    choices = body.get("choices") or [{}]
    if api == "chat":
        answer.text = (choices[0].get("message") or {}).get("content") or ""
    else:
        answer.text = choices[0].get("text") or ""
