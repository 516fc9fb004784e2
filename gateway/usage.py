"""What a request actually used, read from the engine's answer as it passes through.

Tokens are charged against a tenant's TPM up front (the worst case) and refunded to the
actual usage afterwards. A non-streaming answer carries `usage`; a stream carries it in its
last event only when the client asked for `stream_options.include_usage`; otherwise the
completion tokens are counted as the stream's content events (vLLM sends one token per
event per choice), which is close but not exact.
"""

from __future__ import annotations

import json

MAX_BODY = 1 << 20  # non-streaming answers larger than this are not parsed for usage


class UsageMeter:
    def __init__(self, *, streaming: bool, prompt_tokens: int) -> None:
        self.streaming = streaming
        self.prompt_tokens = prompt_tokens
        self._body = bytearray()
        self._events = 0
        self._reported: int | None = None
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        if not self.streaming:
            if len(self._body) <= MAX_BODY:
                self._body += chunk
            return
        data = self._tail + chunk
        *events, self._tail = data.split(b"\n\n")
        for event in events:
            self._event(event.strip())

    def _event(self, event: bytes) -> None:
        if not event.startswith(b"data:"):
            return
        payload = event[5:].strip()
        if payload == b"[DONE]":
            return
        if b'"usage"' in payload:
            usage = _usage(payload)
            if usage is not None:
                self._reported = usage
                return
        self._events += 1

    @property
    def streamed_tokens(self) -> int:
        """Content events of a stream so far: its generated tokens, all choices together."""
        return self._events

    def total_tokens(self) -> int | None:
        """Prompt + completion tokens used; None when the answer did not say and cannot tell."""
        if self.streaming:
            if self._reported is not None:
                return self._reported
            return self.prompt_tokens + self._events
        return _usage(bytes(self._body))


def _usage(payload: bytes) -> int | None:
    try:
        usage = json.loads(payload).get("usage")
        total = usage.get("total_tokens") if isinstance(usage, dict) else None
    except (ValueError, AttributeError):
        return None
    return total if isinstance(total, int) and total >= 0 else None
