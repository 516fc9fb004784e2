"""`x-request-id`: kept when it is visible ASCII within 128 characters, replaced otherwise
(the replacement returned); the engine gets an id no other request has."""

import asyncio
import dataclasses
import re

import httpx
import pytest

from tests.integration.conftest import FAST, gateway_over
from tests.integration.scripted_engine import tenant_with_key

BODY = {"model": "tiny", "prompt": "x", "max_tokens": 2}


async def engine_ids(http: httpx.AsyncClient, engine_url: str) -> list[str]:
    return (await http.get(engine_url + "/sim/state")).json()["x_request_ids"]


@pytest.mark.parametrize(
    "sent",
    [
        "héllo".encode(),  # UTF-8 bytes: read as latin-1, they came back as other bytes
        b"caf\xe9",  # latin-1
        b"two words",
        b"tab\there",
        b"x" * 129,
    ],
    ids=["utf-8", "latin-1", "space", "tab", "too-long"],
)
async def test_an_unusable_request_id_is_replaced_and_the_replacement_returned(sent):
    async with gateway_over([FAST]) as gw, httpx.AsyncClient(timeout=10) as http:
        returned = []
        for body in (BODY, {"model": "tiny"}):  # an answer, and a refusal (400)
            r = await http.post(
                gw.url + "/v1/completions", json=body, headers=[(b"x-request-id", sent)]
            )
            (value,) = [v for k, v in r.headers.raw if k.lower() == b"x-request-id"]
            assert re.fullmatch(rb"[0-9a-f]{32}", value), (sent, value)
            returned.append(value.decode())
        assert returned[0] != returned[1]
        (received,) = await engine_ids(http, gw.engines[0].url)
        assert received.startswith(returned[0] + "-")


async def test_a_usable_request_id_is_kept_and_the_engine_gets_it_with_a_suffix():
    given = "Req_1-2.3:4/5~!" + "z" * 113  # 128 visible ASCII characters
    async with gateway_over([FAST]) as gw, httpx.AsyncClient(timeout=10) as http:
        r = await http.post(gw.url + "/v1/completions", json=BODY, headers={"x-request-id": given})
        assert r.status_code == 200 and r.headers["x-request-id"] == given
        (received,) = await engine_ids(http, gw.engines[0].url)
        assert received.startswith(given + "-") and len(received) > len(given) + 1


async def test_two_tenants_sending_one_id_at_once_reach_the_engine_with_distinct_ids():
    """Older vLLM refuses an id already in flight (400, `--reject-duplicate-request-ids` in
    the simulator); newer ones would log two requests under one id. Both requests must be
    served, and the engine must have seen two ids."""
    slow = dataclasses.replace(FAST, decode_ms_base=5.0, reject_duplicate_request_ids=True)
    a, auth_a = tenant_with_key("a")
    b, auth_b = tenant_with_key("b")
    async with gateway_over([slow], tenants=[a, b]) as gw, httpx.AsyncClient(timeout=30) as http:
        body = BODY | {"max_tokens": 40, "ignore_eos": True}
        answers = await asyncio.gather(
            *(
                http.post(
                    gw.url + "/v1/completions",
                    json=body,
                    headers={**auth, "x-request-id": "same-id"},
                )
                for auth in (auth_a, auth_b)
            )
        )
        assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
        assert [r.headers["x-request-id"] for r in answers] == ["same-id", "same-id"]
        received = await engine_ids(http, gw.engines[0].url)
        assert len(received) == 2 and len(set(received)) == 2, received
        assert all(x.startswith("same-id-") for x in received), received
        state = (await http.get(gw.engines[0].url + "/sim/state")).json()
        assert state["peak_running"] == 2  # they really were in flight together
