"""Upstream misbehaviour becomes OpenAI errors: a silent engine, a stalled stream, a 500."""

import asyncio
import contextlib
import json
import logging

import httpx
import openai
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway.config import parse_config
from gateway.embedded import running_app
from gateway.harness import free_port
from gateway.http.app import create_app
from gateway.runtime import build_runtime
from tests.admin import ADMIN_HEADERS
from tests.integration.scripted_engine import engine_app, gateway_in_front, tenant_with_key


async def misbehaving_completions(request: Request) -> Response:
    body = await request.json()
    mode = body["prompt"]
    if mode == "silent":
        await asyncio.sleep(3)
    if mode == "fail":
        return JSONResponse({"error": {"message": "boom"}}, status_code=500)
    if mode == "stall":

        async def events():
            chunk = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n"
            await asyncio.sleep(3)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
    return JSONResponse({"choices": [{"index": 0, "text": "ok"}], "usage": {"total_tokens": 3}})


def gateway(**raw):
    return gateway_in_front(
        engine_app(misbehaving_completions),
        upstream={"first_byte_timeout_s": 1.0, "idle_timeout_s": 1.0},
        health={"scrape_interval_s": 0.2},
        **raw,
    )


async def reserved(http, url):
    status = (await http.get(url + "/admin/status", headers=ADMIN_HEADERS)).json()
    return status["engines"][0]["reserved_blocks"]


async def test_silent_engine_is_504_and_nothing_stays_reserved():
    async with gateway() as url, httpx.AsyncClient(timeout=10) as http:
        r = await http.post(
            url + "/v1/completions", json={"model": "tiny", "prompt": "silent", "max_tokens": 4}
        )
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
        assert await reserved(http, url) == 0


async def test_stalled_stream_ends_with_an_error_event():
    async with gateway() as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=10)
        stream = await client.completions.create(
            model="tiny", prompt="stall", max_tokens=4, stream=True
        )
        got = []
        try:
            async for chunk in stream:
                got.append(chunk)
            raise AssertionError("the stream should have ended with an error")
        except openai.APIError as e:
            assert "did not answer in time" in str(e) and "127.0.0.1" not in str(e)
        assert len(got) == 1  # the chunk before the stall reached the client
        await client.close()
        async with httpx.AsyncClient() as http:
            assert await reserved(http, url) == 0


async def test_engine_500_is_502_in_openai_shape():
    async with gateway() as url, httpx.AsyncClient(timeout=10) as http:
        r = await http.post(
            url + "/v1/completions", json={"model": "tiny", "prompt": "fail", "max_tokens": 4}
        )
        assert r.status_code == 502
        error = r.json()["error"]
        assert error["code"] == "upstream_unavailable" and "boom" not in error["message"]
        ok = await http.post(
            url + "/v1/completions", json={"model": "tiny", "prompt": "fine", "max_tokens": 4}
        )
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "ok"
        assert await reserved(http, url) == 0


async def test_an_engine_error_charges_the_tenant_no_tokens():
    """Tokens are charged up front and refunded to the usage; an engine's error answer has
    none, and it generated nothing: the whole charge comes back. With 12 tokens a minute and
    about 5 charged per request, a third failed request would be a 429 without the refund."""
    tenant, auth = tenant_with_key("t", tpm=12)
    async with gateway(tenants=[tenant]) as url, httpx.AsyncClient(timeout=10) as http:
        body = {"model": "tiny", "prompt": "fail", "max_tokens": 4}
        codes = [
            (
                await http.post(
                    url + "/v1/completions", json=body | {"stream": i % 2 == 1}, headers=auth
                )
            ).status_code
            for i in range(4)
        ]
        assert codes == [502] * 4  # whole and streamed alike
        fine = await http.post(url + "/v1/completions", json=body | {"prompt": "ok"}, headers=auth)
        assert fine.status_code == 200
        assert int(fine.headers["x-ratelimit-remaining-tokens"]) >= 12 - 6


async def test_an_answer_that_never_came_keeps_its_charge():
    """Unlike an error answer, a timeout (or a client gone before a whole answer) proves
    nothing: the engine may have generated everything. The charge stays — else a tenant could
    pass its TPM by giving up on each request. About 42 tokens are charged per request (a
    short prompt + 40): two fit in 100 TPM, the third is refused."""
    tenant, auth = tenant_with_key("t", tpm=100)
    async with gateway(tenants=[tenant]) as url, httpx.AsyncClient(timeout=10) as http:
        body = {"model": "tiny", "prompt": "silent", "max_tokens": 40}
        codes = [
            (await http.post(url + "/v1/completions", json=body, headers=auth)).status_code
            for _ in range(3)
        ]
        assert codes == [504, 504, 429]


async def test_clients_never_see_internal_addresses(caplog):
    """The gateway's own failures — whole answers and mid-stream SSE events alike — name no
    engine address and no library error; the detail is in the log under the request id."""
    caplog.set_level(logging.WARNING, logger="gateway.http.errors")
    dead = free_port()
    dead_engine = {
        "url": f"http://127.0.0.1:{dead}",  # unnamed: its name is its address
        "models": ["tiny"],
        "max_model_len": 512,
        "num_gpu_blocks": 65,
        "block_size": 16,
    }
    async with gateway(routing={"seed": 1}) as url, httpx.AsyncClient(timeout=10) as http:
        engine = httpx.URL((await http.get(url + "/admin/status")).json()["engines"][0]["url"])
        seen: list[tuple[str, str]] = []  # (request id, what the client read)
        for prompt, stream in (("silent", False), ("fail", False), ("fail", True), ("stall", True)):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": stream}
            r = await http.post(url + "/v1/completions", json=body)
            seen.append((r.headers["x-request-id"], r.text))
    async with (
        gateway_in_front_of_dead(dead_engine) as url,
        httpx.AsyncClient(timeout=10) as http,
    ):
        for _ in range(2):  # before the monitor ejects it (502), and after (503)
            r = await http.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
            assert r.status_code in (502, 503)
            seen.append((r.headers["x-request-id"], r.text))
            await asyncio.sleep(0.5)
    for request_id, text in seen:
        for secret in ("127.0.0.1", str(engine.port), str(dead), "boom", "Error", "Connect"):
            assert secret not in text, (secret, text)
        assert request_id in text  # the client can quote it
        logged = [r.getMessage() for r in caplog.records if request_id in r.getMessage()]
        assert len(logged) == 1, logged  # one line with the detail
    details = " ".join(r.getMessage() for r in caplog.records)
    assert "sent nothing" in details and "answered 500" in details and str(dead) in details


@contextlib.asynccontextmanager
async def gateway_in_front_of_dead(engine):
    cfg = parse_config(
        {
            "engines": [engine],
            "models": [{"name": "tiny", "tokenizer": "hf:@tiny"}],
            "health": {"scrape_interval_s": 0.2},
        }
    )
    runtime = await build_runtime(cfg)
    async with running_app(create_app(runtime)) as url:
        yield url
