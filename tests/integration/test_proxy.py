"""Normal traffic through the gateway reaches the engine and comes back unchanged."""

import asyncio
import dataclasses

import httpx
import openai
import pytest

from tests.integration.conftest import FAST, gateway_over

MESSAGES = [{"role": "user", "content": "Hello there, how are you?"}]


def _strip_ids(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


async def test_chat_and_completion_pass_unchanged():
    async with gateway_over([FAST]) as gw:
        engine = gw.engines[0].url
        async with httpx.AsyncClient() as http:
            for path, payload in [
                (
                    "/v1/chat/completions",
                    {"model": "tiny", "messages": MESSAGES, "max_tokens": 9, "seed": 3},
                ),
                (
                    "/v1/completions",
                    {"model": "tiny", "prompt": "Once upon", "max_tokens": 7, "seed": 3},
                ),
            ]:
                direct = await http.post(engine + path, json=payload)
                via = await http.post(gw.url + path, json=payload)
                assert via.status_code == direct.status_code == 200
                assert _strip_ids(via.json()) == _strip_ids(direct.json())
                assert via.headers["content-type"] == direct.headers["content-type"]
                assert via.headers["x-kv-gateway-engine"] == "e0"


async def test_official_client_async_sync_and_streaming():
    async with gateway_over([FAST, FAST]) as gw:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        chat = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5)
        assert chat.usage.completion_tokens == 5
        assert chat.usage.prompt_tokens > 5
        comp = await client.completions.create(model="tiny", prompt="abc", max_tokens=4, n=2)
        assert len(comp.choices) == 2 and comp.usage.completion_tokens == 8

        stream = await client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6

        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        await client.close()

        # The sync client too (in a worker thread: the servers run on this loop).
        import asyncio

        def sync_call() -> str:
            with openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as c:
                r = c.completions.create(model="tiny", prompt="hello", max_tokens=3)
                return r.choices[0].finish_reason

        assert await asyncio.to_thread(sync_call) == "length"


async def test_request_id_passes_through_and_is_generated():
    async with gateway_over([FAST]) as gw, httpx.AsyncClient() as http:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
        given = await http.post(
            gw.url + "/v1/completions", json=body, headers={"x-request-id": "abc-123"}
        )
        assert given.headers["x-request-id"] == "abc-123"
        made = await http.post(gw.url + "/v1/completions", json=body)
        assert len(made.headers["x-request-id"]) >= 16
        bad = await http.post(
            gw.url + "/v1/completions",
            json={"model": "nope", "prompt": "x"},
            headers={"x-request-id": "r-404"},
        )
        assert bad.headers["x-request-id"] == "r-404"


@pytest.mark.parametrize(
    ("payload", "status", "code"),
    [
        ({"model": "nope", "messages": MESSAGES}, 404, "model_not_found"),
        ({"messages": MESSAGES}, 400, "invalid_request"),
        ({"model": "tiny", "messages": []}, 400, "invalid_request"),
        ({"model": "tiny", "messages": MESSAGES, "max_tokens": -5}, 400, "invalid_request"),
        (
            {"model": "tiny", "messages": MESSAGES, "max_tokens": 10**9},
            400,
            "context_length_exceeded",
        ),
        ({"model": "tiny", "messages": MESSAGES, "max_tokens": "lots"}, 400, "invalid_request"),
        ({"model": "tiny", "messages": MESSAGES, "n": 10**6}, 400, "invalid_request"),
    ],
)
async def test_bad_input_is_an_openai_error(payload, status, code):
    async with gateway_over([FAST]) as gw, httpx.AsyncClient() as http:
        r = await http.post(gw.url + "/v1/chat/completions", json=payload)
        assert r.status_code == status
        error = r.json()["error"]
        assert error["code"] == code and error["message"] and "type" in error and "param" in error
        status_after = await gw.status()
        assert all(e["reserved_blocks"] == 0 for e in status_after["engines"])


async def test_malformed_json_and_wrong_routes():
    async with gateway_over([FAST]) as gw, httpx.AsyncClient() as http:
        r = await http.post(
            gw.url + "/v1/chat/completions",
            content=b"{oops",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = await http.get(gw.url + "/v1/chat/completions")
        assert r.status_code == 405 and "error" in r.json()
        r = await http.get(gw.url + "/v2/nothing")
        assert r.status_code == 404 and "error" in r.json()


async def test_official_client_raises_typed_errors():
    async with gateway_over([FAST]) as gw:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nope", messages=MESSAGES)
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            await client.completions.create(model="tiny", prompt="hi", max_tokens=5000)
        await client.close()


async def test_request_that_never_fits_is_400_with_numbers():
    small = FAST.__class__(**{**FAST.__dict__, "num_gpu_blocks": 65, "max_model_len": 1024})
    async with gateway_over([small]) as gw, httpx.AsyncClient() as http:
        # 3 sequences × ceil((prompt + 1000) / 16) blocks cannot fit 64 usable blocks.
        r = await http.post(
            gw.url + "/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 1000, "n": 3},
        )
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert "KV blocks" in message and "at most" in message


async def test_gateway_metrics_count_outcomes_and_state():
    from prometheus_client.parser import text_string_to_metric_families

    async with gateway_over([FAST]) as gw, httpx.AsyncClient() as http:
        await http.post(
            gw.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}
        )
        await http.post(gw.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
        await http.post(gw.url + "/v1/completions", json={"model": "n" * 5000, "prompt": "x"})
        page = (await http.get(gw.url + "/metrics")).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }
    assert samples[("kv_gateway_requests_total", (("model", "tiny"), ("outcome", "200")))] == 1
    # Unknown models share one label value: a client cannot grow the metrics without bound.
    assert (
        samples[
            ("kv_gateway_requests_total", (("model", "unknown"), ("outcome", "model_not_found")))
        ]
        == 2
    )
    assert not any(labels and ("model", "nope") in labels for _, labels in samples)
    assert samples[("kv_gateway_reserved_blocks", (("engine", "e0"),))] == 0
    assert samples[("kv_gateway_engine_healthy", (("engine", "e0"),))] == 1
    assert samples[("kv_gateway_state_up", ())] == 1  # in-process state is never lost
    assert samples[("kv_gateway_admission_wait_seconds_count", (("model", "tiny"),))] == 1
    tiny = (("model", "tiny"),)
    assert samples[("kv_gateway_first_byte_seconds_count", tiny)] == 1
    assert samples[("kv_gateway_request_duration_seconds_count", tiny)] == 1
    first, whole = (
        samples[("kv_gateway_first_byte_seconds_sum", tiny)],
        samples[("kv_gateway_request_duration_seconds_sum", tiny)],
    )
    assert 0 < first <= whole < 30
    assert ("kv_gateway_first_byte_seconds_count", (("model", "nope"),)) not in samples


async def test_streams_filling_the_upstream_pool_do_not_hold_back_token_counts():
    """With the `engine` counter, a request's /tokenize call has a pool of its own: while
    the completions' pool (here one connection) is taken by a stream, the next request is
    still counted and admitted, and only then waits for a connection."""
    slow = dataclasses.replace(FAST, decode_ms_base=10.0)
    async with (
        gateway_over(
            [slow],
            models=[{"name": "tiny", "tokenizer": "engine"}],
            upstream={"max_connections": 1},
        ) as gw,
        httpx.AsyncClient(timeout=30) as http,
    ):
        body = {"model": "tiny", "prompt": "a", "max_tokens": 150, "ignore_eos": True}
        async with http.stream("POST", gw.url + "/v1/completions", json=body | {"stream": True}):
            second = asyncio.create_task(
                http.post(gw.url + "/v1/completions", json=body | {"max_tokens": 2})
            )
            seqs = 0
            for _ in range(100):
                seqs = sum(e["reserved_seqs"] for e in (await gw.status())["engines"])
                if seqs == 2:
                    break
                await asyncio.sleep(0.01)
            assert seqs == 2  # counted and admitted while the stream holds the only connection
        r = await second
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


async def test_a_request_the_engine_refuses_to_count_is_400_not_502():
    """With the `engine` counter, an engine's 400 from /tokenize (its chat template or its
    parser refused the messages) is the client's error, with the engine's reason — not an
    engine failure that clients would retry."""
    async with (
        gateway_over([FAST], models=[{"name": "tiny", "tokenizer": "engine"}]) as gw,
        httpx.AsyncClient(timeout=30) as http,
    ):
        image = {"type": "image_url", "image_url": {"url": "http://example.invalid/a.png"}}
        messages = [{"role": "user", "content": [image]}]
        r = await http.post(
            gw.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": messages, "max_tokens": 4},
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and "multimodal" in error["message"]
        assert "127.0.0.1" not in error["message"]  # the engine's address stays private
        assert all(e["reserved_blocks"] == 0 for e in (await gw.status())["engines"])
