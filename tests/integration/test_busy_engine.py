"""An engine too busy to answer its probes in time, but still streaming, stays in routing.

vLLM on a saturated host (the CI's two cores) answers `/health` and `/metrics` late while it
generates. Ejecting it then turns every request queued for it into a 503 — what the real-vLLM
overload test once saw. Here an engine whose `/health` always takes longer than the probe
timeout streams an answer through the gateway: while its chunks arrive it stays healthy and
new requests are served; once the traffic stops, the same slow probes eject it. An engine
that only trickles an old stream and starts no new answer is forgiven for `busy_grace_s`,
no longer: it may be hung for all new work.
"""

import asyncio
import json

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tests.integration.scripted_engine import engine_app, gateway_in_front

PROBE_TIMEOUT_S = 0.5
CHUNKS, CHUNK_GAP_S = 40, 0.1  # a 4 s stream, many probe timeouts long


async def streaming_completions(request: Request) -> Response:
    body = await request.json()
    if not body.get("stream"):
        return JSONResponse({"choices": [{"index": 0, "text": "ok"}], "usage": {"total_tokens": 3}})

    async def events():
        chunk = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
        for _ in range(CHUNKS):
            yield f"data: {json.dumps(chunk)}\n\n"
            await asyncio.sleep(CHUNK_GAP_S)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def slow_health(request: Request) -> Response:
    await asyncio.sleep(3 * PROBE_TIMEOUT_S)
    return Response()


def gateway(**health):
    return gateway_in_front(
        engine_app(streaming_completions, health=slow_health),
        health={
            "scrape_interval_s": 0.1,
            "timeout_s": PROBE_TIMEOUT_S,
            "timeouts_to_eject": 2,
            "backoff_max_s": 1.0,
            **health,
        },
    )


async def healthy(http: httpx.AsyncClient, url: str) -> bool:
    status = (await http.get(url + "/admin/status")).json()
    return bool(status["engines"][0]["healthy"])


async def test_slow_probes_do_not_eject_an_engine_that_is_streaming():
    async with gateway() as url, httpx.AsyncClient(timeout=10) as http:
        request = {"model": "tiny", "prompt": "x", "max_tokens": 4}
        async with http.stream(
            "POST", url + "/v1/completions", json={**request, "stream": True}
        ) as stream:
            assert stream.status_code == 200
            events = 0
            async for line in stream.aiter_lines():
                if line.startswith("data: {"):
                    events += 1
                if events == CHUNKS // 2:
                    # Well over `timeouts_to_eject` probes have timed out by now (2 s).
                    assert await healthy(http, url)
                    ok = await http.post(url + "/v1/completions", json=request)
                    assert ok.status_code == 200, ok.text
        assert events == CHUNKS
        # Nothing flows any more: the same slow probes now eject it.
        for _ in range(80):
            if not await healthy(http, url):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("an engine with slow probes and no traffic was not ejected")
        refused = await http.post(url + "/v1/completions", json=request)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "no_healthy_engine"


async def test_an_engine_that_starts_no_new_answer_is_forgiven_only_for_the_grace():
    """The same stream, but with `busy_grace_s` 1: nothing new starts after it, so once the
    grace is over the slow probes count again and the engine is ejected mid-stream."""
    async with gateway(busy_grace_s=1.0) as url, httpx.AsyncClient(timeout=10) as http:
        request = {"model": "tiny", "prompt": "x", "max_tokens": 4, "stream": True}
        async with http.stream("POST", url + "/v1/completions", json=request) as stream:
            assert stream.status_code == 200
            events = 0
            ejected_at = None
            async for line in stream.aiter_lines():
                if line.startswith("data: {"):
                    events += 1
                if ejected_at is None and events % 5 == 0 and not await healthy(http, url):
                    ejected_at = events
        assert events == CHUNKS  # ejection takes an engine out of routing, not its streams
        assert ejected_at is not None and ejected_at < CHUNKS, "not ejected while trickling"
