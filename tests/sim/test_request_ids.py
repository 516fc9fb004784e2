"""x-request-id over HTTP: every value recorded, vLLM's answer ids, the old duplicate 400."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from gateway.sim.request_ids import RequestIdLog
from tests.sim.conftest import SimFactory, state, wait_idle

COMPLETION = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_the_log_is_bounded_and_counts_what_is_in_flight() -> None:
    log = RequestIdLog(capacity=3)
    for value in "abcde":
        log.received(value)
    assert log.recent() == ["c", "d", "e"] and log.total == 5
    log.started("x")
    log.started("x")
    log.ended("x")
    assert log.in_flight("x") and log.num_in_flight == 1
    log.ended("x")
    assert not log.in_flight("x") and log.num_in_flight == 0
    with pytest.raises(ValueError):
        RequestIdLog(capacity=0)


async def test_every_received_id_is_recorded_in_order(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim() as url:
        sent = [f"req-{i}" for i in range(6)]
        for i, value in enumerate(sent):
            path, body = (
                ("/v1/chat/completions", CHAT) if i % 2 else ("/v1/completions", COMPLETION)
            )
            reply = await client.post(f"{url}{path}", json=body, headers={"x-request-id": value})
            # vLLM's answer id is based on the header.
            assert reply.json()["id"] == ("chatcmpl-" if i % 2 else "cmpl-") + value
        without = (await client.post(f"{url}/v1/completions", json=COMPLETION)).json()
        assert without["id"].startswith("cmpl-") and without["id"] != "cmpl-"
        # Refused requests are recorded too: the log is of what arrived.
        bad = await client.post(
            f"{url}/v1/completions", json={"prompt": []}, headers={"X-Request-Id": "bad-1"}
        )
        assert bad.status_code == 400
        st = await state(client, url)
        assert st["x_request_ids"] == [*sent, "bad-1"] and st["x_request_ids_total"] == 7


async def test_equal_ids_in_flight_are_accepted_by_default(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(decode_ms_base=10) as url:
        body = {**COMPLETION, "max_tokens": 10}
        replies = await asyncio.gather(
            *(
                client.post(f"{url}/v1/completions", json=body, headers={"x-request-id": "same"})
                for _ in range(3)
            )
        )
        assert [r.status_code for r in replies] == [200, 200, 200]
        assert {r.json()["id"] for r in replies} == {"cmpl-same"}
        st = await wait_idle(client, url)
        assert st["x_request_ids"] == ["same"] * 3


SLOW_COMPLETION = {**COMPLETION, "max_tokens": 30}
SLOW_CHAT = {**CHAT, "max_tokens": 30, "ignore_eos": True}


@pytest.mark.parametrize(
    ("path", "first", "second", "engine_id"),
    [
        ("/v1/completions", SLOW_COMPLETION, COMPLETION, "cmpl-dup-0"),
        ("/v1/chat/completions", SLOW_CHAT, CHAT, "chatcmpl-dup"),
        ("/v1/completions", {**SLOW_COMPLETION, "n": 2}, {**COMPLETION, "n": 2}, "0_cmpl-dup-0"),
        # Per prompt ids: a 2-prompt request in flight holds cmpl-dup-0 and cmpl-dup-1.
        (
            "/v1/completions",
            {**SLOW_COMPLETION, "prompt": [[5, 6], [7, 8]]},
            {**COMPLETION, "prompt": [[9], [5, 6, 7]]},
            "cmpl-dup-0",
        ),
    ],
)
async def test_old_vllm_refused_an_id_already_in_flight(
    sim: SimFactory,
    client: httpx.AsyncClient,
    path: str,
    first: dict[str, Any],
    second: dict[str, Any],
    engine_id: str,
) -> None:
    async with sim(reject_duplicate_request_ids=True, decode_ms_base=20) as url:
        headers = {"x-request-id": "dup"}
        running = asyncio.create_task(client.post(f"{url}{path}", json=first, headers=headers))
        await _until_in_engine(client, url)
        refused = await client.post(f"{url}{path}", json=second, headers=headers)
        assert refused.status_code == 400
        assert refused.json() == {
            "error": {
                "message": f"Request id {engine_id} already running.",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        }
        assert (await running).status_code == 200
        # Once it has ended, the id is free again.
        again = await client.post(f"{url}{path}", json=second, headers=headers)
        assert again.status_code == 200


async def test_old_vllm_ids_differ_by_endpoint_and_n(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    """cmpl-dup-0 in flight collides with neither chatcmpl-dup nor 0_cmpl-dup-0."""
    async with sim(reject_duplicate_request_ids=True, decode_ms_base=20) as url:
        headers = {"x-request-id": "dup"}
        running = asyncio.create_task(
            client.post(f"{url}/v1/completions", json=SLOW_COMPLETION, headers=headers)
        )
        await _until_in_engine(client, url)
        chat = await client.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers)
        two = await client.post(
            f"{url}/v1/completions", json={**COMPLETION, "n": 2}, headers=headers
        )
        assert (chat.status_code, two.status_code) == (200, 200)
        assert (await running).status_code == 200


async def _until_in_engine(client: httpx.AsyncClient, url: str) -> None:
    async with asyncio.timeout(5):
        while True:  # poll until the first request is in the engine
            if (await state(client, url))["requests"]:
                return
            await asyncio.sleep(0.005)
