"""Retry delays as the official OpenAI SDKs compute them."""

from __future__ import annotations

import email.utils
import random

import pytest

from gateway.loadtest.retry import advised_delay, delay

NOW = 1_800_000_000.0


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"retry-after-ms": "250"}, 0.25),
        ({"Retry-After-Ms": "250", "Retry-After": "9"}, 0.25),  # ms first, any case
        ({"retry-after": "3"}, 3.0),
        ({"retry-after": "0.5"}, 0.5),
        ({"retry-after": email.utils.formatdate(NOW + 4, usegmt=True)}, 4.0),
        ({"retry-after": "soon"}, None),
        ({}, None),
    ],
)
def test_advised(headers: dict[str, str], seconds: float | None) -> None:
    got = advised_delay(headers, NOW)
    assert got == (None if seconds is None else pytest.approx(seconds, abs=1.0))


def test_advice_is_followed_when_within_a_minute() -> None:
    d = delay({"retry-after-ms": "1500"}, 0, random.Random(0), NOW)
    assert (d.seconds, d.advised) == (1.5, True)


@pytest.mark.parametrize("headers", [{}, {"retry-after": "600"}, {"retry-after-ms": "-5"}])
def test_backoff_otherwise(headers: dict[str, str]) -> None:
    rng = random.Random(0)
    waits = [delay(headers, n, rng, NOW) for n in range(6)]
    assert not any(w.advised for w in waits)
    for n, w in enumerate(waits):
        cap = min(0.5 * 2**n, 8.0)
        assert 0.75 * cap <= w.seconds <= cap
