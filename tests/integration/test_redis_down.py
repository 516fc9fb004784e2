"""Redis unreachable: the gateway's own endpoints still answer, in the OpenAI shape.

`/metrics` is scraped most when something is wrong: it keeps answering, says the state is
down (`kv_gateway_state_up 0`) and keeps the gauges read from Redis at their last values.
`/admin/status` and the completions answer 503 as JSON (`fail_closed`), never a bare 500.
"""

import asyncio
import logging
import uuid

import httpx
import pytest

from tests.integration.conftest import FAST, gateway_over
from tests.state.tcp_proxy import TcpProxy

pytestmark = pytest.mark.redis


def gauge(text: str, name: str) -> float:
    (line,) = [x for x in text.splitlines() if x.startswith(name + " ")]
    return float(line.split()[1])


@pytest.mark.parametrize("on_failure", ["fail_closed", "fail_open_local"])
async def test_endpoints_answer_while_redis_is_unreachable(on_failure):
    proxy = TcpProxy()
    await proxy.start()
    redis = {
        "url": proxy.url,
        "key_prefix": f"t{uuid.uuid4().hex[:10]}",
        "timeout_s": 0.5,
        "on_failure": on_failure,
    }
    closed = on_failure == "fail_closed"
    try:
        async with gateway_over([FAST], redis=redis) as gw, httpx.AsyncClient(timeout=10) as http:
            up = await http.get(gw.url + "/metrics")
            assert up.status_code == 200 and gauge(up.text, "kv_gateway_state_up") == 1
            await proxy.stop()

            down = await http.get(gw.url + "/metrics")
            assert down.status_code == 200
            assert gauge(down.text, "kv_gateway_state_up") == 0
            assert gauge(down.text, 'kv_gateway_engine_healthy{engine="e0"}') == 1

            status = await http.get(gw.url + "/admin/status")
            body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
            answer = await http.post(gw.url + "/v1/completions", json=body)
            if closed:
                assert status.status_code == 503
                assert status.json()["error"]["type"] == "service_unavailable"
                assert answer.status_code == 503 and answer.json()["error"]["message"]
            else:  # served on this replica's local share, and still reported as down
                assert status.status_code == 200 and answer.status_code == 200
                after = await http.get(gw.url + "/metrics")
                assert gauge(after.text, "kv_gateway_state_up") == 0

            await proxy.start()  # same port: it resumes
            for _ in range(50):
                back = await http.get(gw.url + "/metrics")
                if gauge(back.text, "kv_gateway_state_up") == 1:
                    break
                await asyncio.sleep(0.1)  # past the store's back-off
            assert gauge(back.text, "kv_gateway_state_up") == 1
    finally:
        await proxy.stop()


async def test_a_lost_redis_is_not_named_to_clients(caplog):
    """503 `state_unavailable` says what happened, not where Redis is or what the library
    said (`Error 111 connecting to 127.0.0.1:…`): that goes to the log with the request id."""
    caplog.set_level(logging.WARNING, logger="gateway.http.errors")
    proxy = TcpProxy()
    await proxy.start()
    redis = {"url": proxy.url, "key_prefix": f"t{uuid.uuid4().hex[:10]}", "timeout_s": 0.5}
    try:
        async with gateway_over([FAST], redis=redis) as gw, httpx.AsyncClient(timeout=10) as http:
            await proxy.stop()
            body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
            answers = [await http.post(gw.url + "/v1/completions", json=body) for _ in range(2)]
            answers.append(await http.get(gw.url + "/admin/status"))
    finally:
        await proxy.stop()
    for answer in answers:
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert error["code"] == "state_unavailable"
        for secret in ("127.0.0.1", str(proxy.port), "Error", "refused"):
            assert secret not in error["message"], error
    details = " ".join(r.getMessage() for r in caplog.records)
    assert answers[0].headers["x-request-id"] in details and "Connect" in details
    for answer in answers[:2]:  # when the gateway tries Redis again (issue 43)
        assert int(answer.headers["retry-after"]) >= 1, answer.headers
        assert 0 < int(answer.headers["retry-after-ms"]) <= 1000, answer.headers
