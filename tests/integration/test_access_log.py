"""`kv-gateway serve --log-format json`: every line on stderr is one JSON object, and each
request that ends writes one access line with its request id, tenant, model, engine, blocks,
outcome, tokens and timings; in the default text format at `info` there is no access line."""

import json

import httpx
import pytest

from gateway.harness import GatewayProcess, SimProcess
from tests.admin import with_admin
from tests.integration.test_tenants import call, tenant


def config(engine: SimProcess) -> dict:
    return with_admin(
        {
            "engines": [{"name": "e0", "url": engine.url, "max_num_seqs": 16}],
            "models": [{"name": "tiny", "tokenizer": "hf:@tiny"}],
            "tenants": [tenant("a"), tenant("b", rpm=1)],
        }
    )


@pytest.fixture
async def engine():
    sim = await SimProcess(num_gpu_blocks=257, max_model_len=512).astart()
    yield sim
    sim.stop()


async def test_json_lines_with_one_access_line_per_request(tmp_path, engine):
    gw = GatewayProcess(config(engine), tmp_path, log_level="info", args=["--log-format", "json"])
    try:
        await gw.astart()
        async with httpx.AsyncClient(timeout=30) as http:
            ok = await call(http, gw.url, "a", 5)
            await call(http, gw.url, "b", 2)
            refused = await call(http, gw.url, "b", 2)
            stranger = await http.post(
                gw.url + "/v1/completions",
                headers={"authorization": "Bearer nobody", "x-request-id": "who-is-this"},
                json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
            )
        assert (ok.status_code, refused.status_code, stranger.status_code) == (200, 429, 401)
    finally:
        gw.stop()
    lines = [json.loads(line) for line in gw.log_text().splitlines() if line.strip()]
    assert all({"ts", "level", "logger", "message"} <= set(line) for line in lines)
    assert any(line["logger"].startswith("uvicorn") for line in lines)  # its lines too
    access = {line["request_id"]: line for line in lines if line["logger"] == "gateway.access"}
    assert len(access) == 4
    line = access[ok.headers["x-request-id"]]
    assert line["tenant"] == "a" and line["model"] == "tiny" and line["engine"] == "e0"
    assert line["outcome"] == "200" and line["path"] == "/v1/completions"
    assert line["blocks"] == int(ok.headers["x-kv-gateway-blocks"])
    assert line["prefix_credit"] == 0  # nothing else ran beside it
    assert line["prompt_tokens"] == ok.json()["usage"]["prompt_tokens"]
    assert line["completion_tokens"] == 5
    assert 0 <= line["wait_ms"] <= line["first_byte_ms"] <= line["duration_ms"]
    line = access[refused.headers["x-request-id"]]
    assert (line["tenant"], line["outcome"], line["engine"]) == ("b", "tenant_rpm", None)
    assert line["completion_tokens"] == 0 and line["first_byte_ms"] is None
    line = access["who-is-this"]
    assert (line["tenant"], line["outcome"], line["model"]) == (None, "invalid_api_key", None)


async def test_text_at_info_writes_no_access_line(tmp_path, engine):
    gw = GatewayProcess(config(engine), tmp_path, log_level="info")
    try:
        await gw.astart()
        async with httpx.AsyncClient(timeout=30) as http:
            assert (await call(http, gw.url, "a", 2)).status_code == 200
    finally:
        gw.stop()
    text = gw.log_text()
    assert "gateway.access" not in text
    assert "kv-gateway listening on" in text
