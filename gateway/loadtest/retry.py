"""429s as the official OpenAI SDKs handle them: wait what the server advises, then retry.

The SDKs read `retry-after-ms` (milliseconds), else `Retry-After` (seconds, or an HTTP
date), and use it when it is between 0 and 60 s; otherwise they back off exponentially
(0.5 s doubling to at most 8 s, minus up to 25 % jitter). `delay` is that decision, pure:
the jitter draw and the current time are passed in.
"""

from __future__ import annotations

import email.utils
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

MAX_ADVISED_S = 60.0
INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0


@dataclass(frozen=True, slots=True)
class RetryDelay:
    seconds: float
    advised: bool  # True when the server's header decided it


def advised_delay(headers: Mapping[str, str], now_epoch: float) -> float | None:
    """What the server advises, in seconds, or None (absent or unreadable)."""
    lower = {k.lower(): v for k, v in headers.items()}
    raw_ms = lower.get("retry-after-ms")
    if raw_ms is not None:
        try:
            value = float(raw_ms) / 1000.0
            if math.isfinite(value):
                return value
        except ValueError:
            pass
    raw = lower.get("retry-after")
    if raw is None:
        return None
    try:
        value = float(raw)
        return value if math.isfinite(value) else None
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return when.timestamp() - now_epoch


def delay(
    headers: Mapping[str, str], retries_so_far: int, rng: random.Random, now_epoch: float
) -> RetryDelay:
    """How long to wait before retry number `retries_so_far + 1`."""
    advised = advised_delay(headers, now_epoch)
    if advised is not None and 0 <= advised <= MAX_ADVISED_S:
        return RetryDelay(advised, True)
    backoff = min(INITIAL_BACKOFF_S * 2**retries_so_far, MAX_BACKOFF_S)
    return RetryDelay(backoff * (1 - 0.25 * rng.random()), False)
