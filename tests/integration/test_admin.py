"""The admin surface (`/admin/*`, `/metrics`) with and without `admin.api_keys`; `/health`
and `/ready` open to anyone and naming no engine; `/v1/models` behind the tenants' keys."""

import hashlib

import httpx
import pytest

from tests.integration.conftest import FAST, gateway_over
from tests.integration.scripted_engine import tenant_with_key

ADMIN = ["/admin/status", "/metrics"]


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_admin_keys_guard_status_and_metrics():
    tenant, tenant_auth = tenant_with_key("t")
    admin = {"api_keys": [digest("ops-1"), "sha256:" + digest("ops-2")]}
    async with (
        gateway_over([FAST], tenants=[tenant], admin=admin) as gw,
        httpx.AsyncClient(timeout=10) as http,
    ):
        for path in ADMIN:
            for headers, status in [
                ({}, 401),  # nobody: what anyone on the network could read before
                (bearer("ops-3"), 401),
                (tenant_auth, 401),  # a tenant is not an admin
                ({"authorization": "ops-1"}, 401),
                (bearer("ops-1"), 200),
                (bearer("ops-2"), 200),
            ]:
                r = await http.get(gw.url + path, headers=headers)
                assert r.status_code == status, (path, headers, r.text)
                if status == 401:
                    assert r.json()["error"]["code"] == "invalid_api_key"
                    assert "e0" not in r.text and "127.0.0.1" not in r.text
        assert (
            "kv_gateway_reserved_blocks"
            in (await http.get(gw.url + "/metrics", headers=bearer("ops-1"))).text
        )


async def test_tenants_without_admin_keys_close_the_admin_surface():
    tenant, tenant_auth = tenant_with_key("t")
    async with (
        gateway_over([FAST], tenants=[tenant], admin={"api_keys": []}) as gw,
        httpx.AsyncClient(timeout=10) as http,
    ):
        for path in ADMIN:
            for headers in ({}, tenant_auth):
                r = await http.get(gw.url + path, headers=headers)
                assert r.status_code == 403, (path, r.text)
                assert r.json()["error"]["code"] == "admin_disabled"
        ok = await http.post(
            gw.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=tenant_auth
        )
        assert ok.status_code == 200


@pytest.mark.parametrize("admin", [None, {"api_keys": [digest("ops")]}])
async def test_without_tenants_the_api_is_open_and_admin_keys_still_guard(admin):
    overrides = {} if admin is None else {"admin": admin}
    async with gateway_over([FAST], **overrides) as gw, httpx.AsyncClient(timeout=10) as http:
        for path in ADMIN:
            r = await http.get(gw.url + path)
            assert r.status_code == (200 if admin is None else 401), path
        ok = await http.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert ok.status_code == 200
        assert (await http.get(gw.url + "/v1/models")).status_code == 200


async def test_health_and_ready_stay_open_and_name_no_engine():
    tenant, tenant_auth = tenant_with_key("t")
    async with (
        gateway_over([FAST, FAST], tenants=[tenant]) as gw,
        httpx.AsyncClient(timeout=10) as http,
    ):
        health = await http.get(gw.url + "/health")
        ready = await http.get(gw.url + "/ready")
        assert health.status_code == ready.status_code == 200
        assert ready.json() == {
            "status": "ready",
            "models": {"tiny": {"healthy_engines": 2, "engines": 2}},
            "unserved": [],
        }
        for engine in gw.engines:
            port = str(httpx.URL(engine.url).port)
            for text in (health.text, ready.text):
                assert port not in text and "127.0.0.1" not in text and "e0" not in text
        # The models a tenant may use: a tenant's key, as for the completions.
        assert (await http.get(gw.url + "/v1/models")).status_code == 401
        models = await http.get(gw.url + "/v1/models", headers=tenant_auth)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"


async def test_an_unnamed_engine_is_not_named_to_clients():
    """`x-kv-gateway-engine` names engines the operator named; an unnamed engine's name is
    its host:port."""
    async with gateway_over([FAST]) as named, httpx.AsyncClient(timeout=10) as http:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
        r = await http.post(named.url + "/v1/completions", json=body)
        assert r.headers["x-kv-gateway-engine"] == "e0"
        engines = [{"url": named.engines[0].url, "max_num_seqs": 8, "num_gpu_blocks": 17}]
        port = str(httpx.URL(named.engines[0].url).port)
        async with gateway_over([], engines=engines) as unnamed:
            r = await http.post(unnamed.url + "/v1/completions", json=body)
            assert r.status_code == 200 and "x-kv-gateway-engine" not in r.headers
            assert port not in str(r.headers)
            # A request that never fits (more blocks than the engine admits) is refused with
            # the engine's numbers; its name there is an alias, not its host:port.
            never = await http.post(
                unnamed.url + "/v1/completions", json=body | {"max_tokens": 900}
            )
            assert never.status_code == 400 and "engine '#1' admits" in never.text, never.text
            assert port not in never.text and "127.0.0.1" not in never.text
