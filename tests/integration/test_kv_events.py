"""The prefix index's exact mode through a running gateway: engines configured with
`kv_events` are followed from start-up (a real ZMQ PUB socket per engine plays vLLM's
publisher, the engines are simulated), their events are what the gateway expects them to
cache, routing follows it, `/admin/status` shows it, and shutdown closes the subscriber."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from gateway.config import ConfigError
from gateway.harness import free_port
from tests.admin import ADMIN_HEADERS
from tests.core.test_kv_events import stored as block_stored
from tests.integration.conftest import FAST, gateway_over
from tests.integration.test_dashboard import validate

BS = FAST.block_size
P = [10 + i for i in range(4 * BS)]  # two prompts of 4 full blocks, no block alike
Q = [200 + i for i in range(4 * BS)]


def stored(seq: int, hashes: list[int], tokens: list[int]) -> list[bytes]:
    """A message as vLLM 0.32's publisher sends it (see tests/engines/test_kv_events.py)."""
    event = block_stored(hashes, None, tokens, block_size=BS)
    return [b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [event], 0])]


@pytest.fixture
def publishers() -> Iterator[list[tuple[str, zmq.Socket[bytes]]]]:
    ctx = zmq.Context()
    socks = []
    for _ in range(2):
        port = free_port()
        sock = ctx.socket(zmq.PUB)
        sock.bind(f"tcp://127.0.0.1:{port}")
        socks.append((f"tcp://127.0.0.1:{port}", sock))
    yield socks
    for _, sock in socks:
        sock.close(linger=0)
    ctx.term()


async def prefix_index(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    status = (await http.get(url + "/admin/status", headers=ADMIN_HEADERS)).json()
    validate(status)  # docs/status.schema.json, kv_events counts included
    return {e["name"]: e["prefix_index"] for e in status["engines"]}


async def test_followed_engines_are_expected_to_cache_what_their_events_report(
    publishers: list[tuple[str, zmq.Socket[bytes]]],
) -> None:
    settings = [{"kv_events": endpoint} for endpoint, _ in publishers]
    async with (
        gateway_over([FAST, FAST], engine_settings=settings) as gw,
        httpx.AsyncClient(timeout=10) as http,
    ):
        assert gw.runtime.kv_events is not None
        (_, pub0), (_, pub1) = publishers
        # A PUB socket drops messages until the subscriber has joined: repeat the batch
        # (the same blocks, so the index holds them once) until it shows.
        for seq in range(200):
            pub0.send_multipart(stored(seq, [11, 12, 13, 14], Q))
            pub1.send_multipart(stored(seq, [21, 22, 23, 24], P))
            await asyncio.sleep(0.02)
            index = await prefix_index(http, gw.url)
            if index["e0"]["blocks"] and index["e1"]["blocks"]:
                break
        assert index["e0"]["blocks"] == 4 and index["e1"]["blocks"] == 4, index
        # Each prompt goes where its blocks are cached (most_free_after credits them there).
        for prompt, engine in ((P, "e1"), (Q, "e0"), (P, "e1")):
            r = await http.post(
                gw.url + "/v1/completions",
                json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-kv-gateway-engine"] == engine
        # What the gateway sent is not recorded for a followed engine: only its events.
        index = await prefix_index(http, gw.url)
        assert index["e0"]["blocks"] == 4 and index["e1"]["blocks"] == 4
        assert index["e0"]["kv_events"]["stored"] >= 4
        assert index["e0"]["kv_events"]["skipped"] == 0
        assert index["e0"]["kv_events"]["resets"] == 0
        subscriber = gw.runtime.kv_events
    assert subscriber._ctx is None  # the runtime's shutdown closed it


async def test_an_engine_serving_several_models_cannot_be_followed() -> None:
    settings = [{"kv_events": "tcp://127.0.0.1:9", "models": ["tiny", "tiny-lora"]}]
    with pytest.raises(ConfigError, match=r"kv_events.*serving one model"):
        async with gateway_over([FAST], engine_settings=settings):
            pass


async def test_without_pyzmq_or_msgspec_kv_events_is_a_config_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "gateway.engines.kv_events", None)  # as if not installed
    settings = [{"kv_events": "tcp://127.0.0.1:9"}]
    with pytest.raises(ConfigError, match=r"kv-gateway\[kv-events\]"):
        async with gateway_over([FAST], engine_settings=settings):
            pass
    async with gateway_over([FAST]) as gw:  # without kv_events nothing needs them
        assert gw.runtime.kv_events is None
