"""The Responses API id log at /admin/status (issue 38): a bounded cache a soak must fill,
so its size is shown where the soak (and an operator) can read it. A real simulator serving
`/v1/responses` behind the gateway, over loopback."""

import httpx

from gateway.config import parse_config
from gateway.embedded import running_app
from gateway.harness import SimProcess
from gateway.http.app import create_app
from gateway.runtime import build_runtime
from gateway.stored_responses import MAX_STORED
from tests.admin import ADMIN_HEADERS, with_admin


async def test_each_stored_response_is_counted_at_admin_status():
    sim = SimProcess(block_size=16, max_model_len=512, num_gpu_blocks=257)
    await sim.astart()
    try:
        raw = {
            "engines": [{"name": "a", "url": sim.url}],
            "models": [{"name": "tiny", "tokenizer": "hf:@tiny"}],
        }
        runtime = await build_runtime(parse_config(with_admin(raw)))
        async with running_app(create_app(runtime)) as url, httpx.AsyncClient(timeout=30) as http:

            async def log() -> dict[str, int]:
                status = await http.get(url + "/admin/status", headers=ADMIN_HEADERS)
                return status.json()["process"]["stored_responses"]

            assert await log() == {"entries": 0, "max": MAX_STORED}
            body = {"model": "tiny", "input": "hello there", "max_output_tokens": 4}
            first = await http.post(url + "/v1/responses", json=body)
            assert first.status_code == 200, first.text
            streamed = await http.post(url + "/v1/responses", json={**body, "stream": True})
            assert streamed.status_code == 200 and "response.completed" in streamed.text
            assert await log() == {"entries": 2, "max": MAX_STORED}
            # Going back to it: known, so the log does not grow by the id it already holds.
            again = await http.post(
                url + "/v1/responses",
                json={**body, "previous_response_id": first.json()["id"]},
            )
            assert again.status_code == 200, again.text
            assert await log() == {"entries": 3, "max": MAX_STORED}
    finally:
        sim.stop()
