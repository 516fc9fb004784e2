"""Tenants through one in-process gateway (the embedded default's state store)."""

import asyncio
import dataclasses
import hashlib

import httpx

from tests.integration.conftest import FAST, gateway_over

ENGINE = dataclasses.replace(
    FAST, num_gpu_blocks=1025, max_num_seqs=64, max_model_len=512, decode_ms_base=3.0
)


def tenant(name, **limits):
    return {
        "name": name,
        "api_keys": [hashlib.sha256(f"key-{name}".encode()).hexdigest()],
        **limits,
    }


async def call(http, url, name, max_tokens=50):
    return await http.post(
        url + "/v1/completions",
        headers={"authorization": f"Bearer key-{name}"},
        json={
            "model": "tiny",
            "prompt": [1, 2, 3, 4],
            "max_tokens": max_tokens,
            "ignore_eos": True,
        },
    )


async def test_limits_codes_and_headers_in_process():
    tenants = [
        tenant("a", max_concurrency=2),
        tenant("b", rpm=5),
        tenant("c", tpm=100),
        tenant("d", kv_share=0.05),
    ]
    async with gateway_over([ENGINE], tenants=tenants) as gw, httpx.AsyncClient(timeout=30) as http:
        conc = await asyncio.gather(*(call(http, gw.url, "a", 100) for _ in range(6)))
        assert [r.status_code for r in conc].count(200) >= 2
        assert {r.json()["error"]["code"] for r in conc if r.status_code == 429} == {
            "tenant_concurrency"
        }
        assert gw.engines[0].sim.engine.snapshot().peak_running <= 2

        rpm = [await call(http, gw.url, "b", 2) for _ in range(7)]
        assert [r.status_code for r in rpm] == [200] * 5 + [429] * 2
        assert rpm[-1].json()["error"]["code"] == "tenant_rpm"
        assert rpm[0].headers["x-ratelimit-limit-requests"] == "5"
        assert rpm[4].headers["x-ratelimit-remaining-requests"] == "0"
        assert rpm[-1].headers["x-ratelimit-reset-requests"].endswith("s")

        too_big = await call(http, gw.url, "c", 200)  # 4 + 200 tokens > the whole 100 TPM
        assert too_big.status_code == 429
        assert "whole limit" in too_big.json()["error"]["message"]

        # kv_share 0.05 of 972 admissible blocks = 48 blocks; each request holds ceil(104/16) = 7.
        share = await asyncio.gather(*(call(http, gw.url, "d", 100) for _ in range(10)))
        assert [r.status_code for r in share].count(200) >= 6
        assert {r.json()["error"]["code"] for r in share if r.status_code == 429} <= {
            "tenant_kv_share"
        }

        missing = await http.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        status = await gw.status()
        assert status["queue"]["length"] == 0
        assert all(e["reserved_blocks"] == 0 for e in status["engines"])


async def test_ratelimit_headers_of_a_granted_request_come_with_its_admission():
    """No second trip to the store for the headers: the admission reported the limits."""
    tenants = [tenant("b", rpm=5, tpm=1000)]
    async with gateway_over([ENGINE], tenants=tenants) as gw, httpx.AsyncClient(timeout=30) as http:

        async def not_asked(_tenant):
            raise AssertionError("rate_limits was asked for a granted request")

        gw.runtime.store.rate_limits = not_asked
        r = await call(http, gw.url, "b", 50)
    assert r.status_code == 200
    assert r.headers["x-ratelimit-remaining-requests"] == "4"
    assert r.headers["x-ratelimit-limit-tokens"] == "1000"
    assert r.headers["x-ratelimit-remaining-tokens"] == str(1000 - (4 + 50))  # charged up front


async def test_a_stream_without_usage_is_refunded_to_what_it_used():
    """Charged up front for the worst case (n × (prompt + max_tokens) = 3 × (4 + 5) = 27),
    a stream that does not ask for `usage` is refunded to what the gateway counted: the
    prompt once, as vLLM counts it, plus one token per content event (15), so 19 stay
    charged. With 60 tokens a minute (one back per second), the next request (4 + 5 = 9)
    leaves 60 − 19 − 9 = 32."""
    async with (
        gateway_over([ENGINE], tenants=[tenant("s", tpm=60)]) as gw,
        httpx.AsyncClient(timeout=30) as http,
    ):
        auth = {"authorization": "Bearer key-s"}
        body = {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 5, "ignore_eos": True}
        stream = await http.post(
            gw.url + "/v1/completions", json=body | {"n": 3, "stream": True}, headers=auth
        )
        assert stream.status_code == 200 and stream.text.count('"text"') == 15
        after = await http.post(gw.url + "/v1/completions", json=body, headers=auth)
        assert after.status_code == 200
        assert 32 <= int(after.headers["x-ratelimit-remaining-tokens"]) <= 33
