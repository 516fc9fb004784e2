"""The prefix index's exact mode on the real engine (issue 15): the gateway follows vLLM's
KV-cache events (`engines[].kv_events`) and then holds exactly the blocks vLLM reports
cached, hashed as its own, so that routing finds them.

The package's engine publishes its events (tests/e2e/conftest.py `vllm_kv_events`). The test
listens too, with its own ZMQ socket and its own reading of the messages, and compares. The
gateway is given the engine twice: `vllm0` followed by its events, `vllm1` (the same URL)
not. Prompts are sent straight to vLLM, so only the events can tell the gateway about them:
a repeat through the gateway goes to `vllm0`, where most_free_after credits the cached
blocks, and not to `vllm1`, which knows nothing. Token-id prompts: what vLLM hashes is
exactly what the gateway hashes.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from tests.e2e import conftest
from tests.e2e.gateway_process import gateway_config, serving_gateway

pytestmark = pytest.mark.vllm

BS = conftest.BLOCK_SIZE
RNG = random.Random(time.time_ns())


def prompt(tokens: int) -> list[int]:
    """Token ids no earlier prompt starts with (the tiny model's vocabulary is 2,048)."""
    return [RNG.randrange(5, 2000) for _ in range(tokens)]


class Listener:
    """The test's own subscriber: every batch as `(seq, [event as a map])`."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.batches: list[tuple[int, list[dict[str, Any]]]] = []

    def drain(self, until: float) -> None:
        while self.sock.poll(max(0, int((until - time.monotonic()) * 1000))):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == b"kv-events"
            _ts, events, *_rank = msgspec.msgpack.decode(payload)
            self.batches.append((int.from_bytes(seq, "big"), events))
            if time.monotonic() >= until:
                break

    def stored(self, tokens: list[int]) -> list[Any]:
        """vLLM's hashes of the full blocks it reported stored for a prompt of `tokens`."""
        full = len(tokens) // BS * BS
        return [
            h
            for _, events in self.batches
            for e in events
            if e["type"] == "BlockStored" and e["token_ids"] == tokens[:full]
            for h in e["block_hashes"]
        ]

    def cached_since(self, first: int) -> Counter[Any]:
        """vLLM's hashes cached now, as the events from `first` on tell (a block whose parent
        came before cannot be known from them: left out, as the gateway leaves it)."""
        live: Counter[Any] = Counter()
        for seq, events in self.batches:
            if seq < first:
                continue
            for e in events:
                if e["type"] == "AllBlocksCleared":
                    live.clear()
                elif e["type"] == "BlockRemoved":
                    for h in e["block_hashes"]:
                        if live[h]:
                            live[h] -= 1
                elif e["parent_block_hash"] is None or live[e["parent_block_hash"]]:
                    live.update(e["block_hashes"])
        return +live

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def complete(url: str, tokens: list[int], **more: Any) -> httpx.Response:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": "tiny", "prompt": tokens, "max_tokens": 2, **more},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r


def feed(gateway: Any) -> dict[str, Any]:
    index = {e["name"]: e["prefix_index"] for e in gateway.status()["engines"]}
    assert index["vllm1"]["kv_events"] is None
    return {"blocks": index["vllm0"]["blocks"], **index["vllm0"]["kv_events"]}


def settled(gateway: Any, listener: Listener, within_s: float = 10.0) -> dict[str, Any]:
    """The gateway's feed once it has read every batch the listener has."""
    listener.drain(time.monotonic() + 0.5)
    last = listener.batches[-1][0]
    deadline = time.monotonic() + within_s
    while (got := feed(gateway))["last_seq"] != last and time.monotonic() < deadline:
        time.sleep(0.1)
    assert got["last_seq"] == last, (got, last)
    return got


def test_the_gateway_holds_what_vllm_reports_cached_and_routes_to_it(
    vllm_url: str, vllm_kv_events: str | None, tmp_path: Path
) -> None:
    if vllm_kv_events is None:
        pytest.skip("a reused engine (KV_VLLM_ENGINE_URL) without KV_VLLM_KV_EVENTS")
    config = gateway_config(vllm_url)
    vllm0 = config["engines"][0]
    config["engines"] = [
        {**vllm0, "kv_events": vllm_kv_events},
        {**vllm0, "name": "vllm1"},
    ]
    listener = Listener(vllm_kv_events)
    try:
        time.sleep(0.5)  # joined before the gateway: it sees all the gateway sees
        with serving_gateway(config, tmp_path) as gateway:
            # The gateway's socket joins in the background: prompts until it reads one.
            for _ in range(20):
                complete(vllm_url, prompt(2 * BS + 10))
                time.sleep(0.5)
                if feed(gateway)["batches"]:
                    break
            joined = settled(gateway, listener)
            assert joined["resets"] == 0, joined
            first = joined["last_seq"] - joined["batches"] + 1

            a, c = prompt(2 * BS + 44), prompt(2 * BS + 44)  # 300 tokens: 2 full blocks each
            complete(vllm_url, a)
            complete(vllm_url, c, cache_salt="tenant-c")
            got = settled(gateway, listener)
            assert len(listener.stored(a)) == 2 and len(listener.stored(c)) == 2
            cached = listener.cached_since(first)
            assert got["blocks"] == sum(cached.values()) and got["skipped"] == 0, (got, cached)

            # vLLM's cached blocks are the gateway's own hashes: the repeats go to vllm0.
            for tokens, more in ((a, {}), (c, {"cache_salt": "tenant-c"})):
                r = complete(gateway.url, tokens, **more)
                assert r.headers["x-kv-gateway-engine"] == "vllm0", (more, r.headers)
            assert settled(gateway, listener)["blocks"] == got["blocks"]  # hits store nothing

            # Prompts of 4 blocks evict the oldest cached blocks: vLLM reports them removed.
            for _ in range(3):
                complete(vllm_url, prompt(3 * BS + 100))
            got = settled(gateway, listener)
            cached = listener.cached_since(first)
            assert got["removed"] > 0 and got["skipped"] == 0, got
            assert got["blocks"] == sum(cached.values()), (got, cached)
            assert not set(listener.stored(a)) & set(cached)  # a's blocks are gone
            conftest.record_figure(
                "exact mode (kv events)",
                f"{got['batches']} batches read, {got['stored']} blocks stored, "
                f"{got['removed']} removed, {got['blocks']} in the index = vLLM's",
            )
    finally:
        listener.close()
