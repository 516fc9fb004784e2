"""What a request actually used, read from the engine's answer as it passes through.

Tokens are charged against a tenant's TPM up front (the worst case) and refunded to the
actual usage afterwards. A non-streaming answer carries `usage`; a stream carries it in its
last event only when the client asked for `stream_options.include_usage`; otherwise the
completion tokens are counted as the stream's content events (vLLM sends one token per
event per choice, after an opening event per choice that carries only the role), which is
close but not exact; the prompt is counted once per prompt, as vLLM's `usage` does. A
Responses stream names its events (`event:` lines): its text deltas are its tokens, and its
`response.completed` event always carries the usage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

MAX_BODY = 1 << 20  # whole answers up to this size are parsed as JSON for their usage
TAIL = 64 << 10  # of a larger one only its end is kept, where vLLM writes `usage`


class UsageMeter:
    def __init__(self, *, streaming: bool, prompt_tokens: int) -> None:
        self.streaming = streaming
        self.prompt_tokens = prompt_tokens
        self._body = bytearray()
        self._too_big = False  # then `_body` holds only the answer's last TAIL bytes
        self._events = 0
        self._reported: _Usage | None = None
        self._parsed: tuple[_Usage | None] | None = None  # a whole answer's, once parsed
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        if not self.streaming:
            self._body += chunk
            if len(self._body) > MAX_BODY or self._too_big:
                self._too_big = True
                del self._body[:-TAIL]
            return
        data = self._tail + chunk
        *events, self._tail = data.split(b"\n\n")
        if len(self._tail) > TAIL:
            # An event this long is not vLLM's usage chunk: keep its end only (its start
            # is gone, so it is passed over), and memory stays bounded.
            self._tail = self._tail[-TAIL:]
        for event in events:
            self._event(event.strip())

    def _event(self, event: bytes) -> None:
        if not event.startswith(b"data:"):
            if event.startswith(b"event:"):
                self._named(event)
            return
        payload = event[5:].strip()
        if payload == b"[DONE]":
            return
        if b'"usage"' in payload:
            usage = _usage(payload)
            if usage is not None:
                self._reported = usage
                return
        if b'"role"' in payload and b'"content":""' in payload:
            return  # a chat stream's opening event per choice: no token yet
        self._events += 1

    def _named(self, event: bytes) -> None:
        """A named event: vLLM's Responses stream (`event: <type>` then `data: <json>`). Its
        tokens are its `response.output_text.delta` events; its usage is in the `response`
        of `response.completed` (the events before it carry `"usage": null`)."""
        head, _, rest = event.partition(b"\n")
        kind = head[6:].strip()
        if kind == b"response.output_text.delta":
            self._events += 1
        elif kind in (b"response.completed", b"response.incomplete") and rest.startswith(b"data:"):
            usage = _usage(rest[5:].strip())
            if usage is not None:
                self._reported = usage

    @property
    def streamed_tokens(self) -> int:
        """A stream's generated tokens so far, all choices together: the engine's own count
        when its events carry `usage` (`continuous_usage_stats`), else the content events."""
        reported = self._reported.completion if self._reported is not None else None
        return self._events if reported is None else reported

    def _whole(self) -> _Usage | None:
        """The `usage` of a whole (non-streamed) answer, parsed once when first asked."""
        if self._parsed is None:
            body = bytes(self._body)
            self._parsed = (_usage_in_tail(body) if self._too_big else _usage(body),)
        return self._parsed[0]

    def total_tokens(self) -> int | None:
        """Prompt + completion tokens used; None when the answer did not say and cannot tell."""
        if not self.streaming:
            usage = self._whole()
            return usage.total if usage is not None else None
        if self._reported is not None and self._reported.total is not None:
            return self._reported.total
        return self.prompt_tokens + self._events

    def completion_tokens(self) -> int | None:
        """Generated tokens, all choices together, as the engine counted them (for a stream
        without `usage`: its content events); None when the answer did not say."""
        if not self.streaming:
            usage = self._whole()
            return usage.completion if usage is not None else None
        return self.streamed_tokens


@dataclass(frozen=True, slots=True)
class _Usage:
    total: int | None
    completion: int | None


def _usage(payload: bytes) -> _Usage | None:
    try:
        data = json.loads(payload)
        usage = data.get("usage")
        if usage is None and isinstance(data.get("response"), dict):
            usage = data["response"].get("usage")  # a Responses stream's last event
    except (ValueError, AttributeError):
        return None
    return _read_usage(usage)


def _read_usage(usage: object) -> _Usage | None:
    """An OpenAI `usage` object's counts; None when it is not one."""
    if not isinstance(usage, dict):
        return None
    completion = usage.get("completion_tokens", usage.get("output_tokens"))  # Responses: output
    got = _Usage(_count(usage.get("total_tokens")), _count(completion))
    return None if got == _Usage(None, None) else got


def _usage_in_tail(tail: bytes) -> _Usage | None:
    """The last `"usage": {...}` object in the end of a large JSON answer."""
    at = tail.rfind(b'"usage"')
    if at < 0:
        return None
    start = tail.find(b"{", at)
    if start < 0:
        return None
    try:
        usage, _ = json.JSONDecoder().raw_decode(tail[start:].decode(errors="replace"))
    except ValueError:
        return None
    return _read_usage(usage)


def _count(x: object) -> int | None:
    return x if isinstance(x, int) and x >= 0 else None
