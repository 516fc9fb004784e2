"""The `predicted` reservation over real sockets: it learns output lengths from completed
requests only, and then reserves prompt + that prediction instead of the whole budget."""

import dataclasses
import hashlib
import math

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import FAST, gateway_over

ENGINE = dataclasses.replace(
    FAST, num_gpu_blocks=101, max_num_seqs=16, max_model_len=1024, decode_ms_base=5.0
)
PROMPT = list(range(100, 110))  # 10 token ids: the footprint is exact
BLOCK = 16


def admission(mode: str, kv_ceiling: float = 1.0) -> dict:
    return {
        "kv_ceiling": kv_ceiling,
        "reservation": mode,
        "prediction": {"quantile": 1.0, "window": 5, "min_samples": 5},
    }


def body(max_tokens: int, *, stream: bool) -> dict:
    return {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


async def reserved_while_streaming(http: httpx.AsyncClient, url: str, max_tokens: int) -> int:
    """Blocks reserved for one streaming request, read after its first event; the client
    then leaves (a request that does not complete teaches nothing)."""
    async with http.stream(
        "POST", url + "/v1/completions", json=body(max_tokens, stream=True)
    ) as r:
        assert r.status_code == 200
        async for _ in r.aiter_lines():
            break
        status = (await http.get(url + "/admin/status")).json()
    return sum(e["reserved_blocks"] for e in status["engines"])


async def metric(http: httpx.AsyncClient, url: str, name: str) -> float | None:
    """The gateway's sample `name` for model tiny, None when there is none."""
    text = (await http.get(url + "/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == {"model": "tiny"}:
                return sample.value
    return None


async def predicted_metric(http: httpx.AsyncClient, url: str) -> float | None:
    return await metric(http, url, "kv_gateway_predicted_output_tokens")


@pytest.mark.parametrize("mode", ["worst_case", "predicted"])
async def test_reservation_follows_learned_output_lengths(mode):
    worst = math.ceil((10 + 600) / BLOCK)  # 39 blocks
    async with (
        gateway_over([ENGINE], admission=admission(mode)) as gw,
        httpx.AsyncClient(timeout=30) as http,
    ):
        # Nothing learned yet: the whole budget, in both modes.
        assert await reserved_while_streaming(http, gw.url, 600) == worst
        # Four complete (output 8 each) and the abandoned ones above and below do not
        # count: still one short of min_samples.
        for _ in range(4):
            r = await http.post(gw.url + "/v1/completions", json=body(8, stream=False))
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert await reserved_while_streaming(http, gw.url, 600) == worst
        assert await predicted_metric(http, gw.url) is None
        r = await http.post(gw.url + "/v1/completions", json=body(8, stream=True))
        assert r.status_code == 200 and "[DONE]" in r.text  # a stream counts too
        assert await predicted_metric(http, gw.url) == 8
        expected = math.ceil((10 + 8) / BLOCK) if mode == "predicted" else worst
        assert await reserved_while_streaming(http, gw.url, 600) == expected
        # A budget below the prediction is reserved as asked.
        assert await reserved_while_streaming(http, gw.url, 3) == 1
        assert not any(await gw.reserved_blocks_settle())  # the abandoned streams' releases


async def test_predicted_mode_still_refuses_what_could_never_fit():
    """Whether a request could ever run is judged on its worst case in both modes."""
    # 24 usable blocks, half of them admissible: 12.
    small = dataclasses.replace(ENGINE, num_gpu_blocks=25, max_model_len=384)
    async with (
        gateway_over([small], admission=admission("predicted", kv_ceiling=0.5)) as gw,
        httpx.AsyncClient(timeout=30) as http,
    ):
        for _ in range(5):
            r = await http.post(gw.url + "/v1/completions", json=body(8, stream=False))
            assert r.status_code == 200
        # Worst case ceil(370 / 16) = 24 blocks > 12, though its prediction (1 block) fits.
        r = await http.post(gw.url + "/v1/completions", json=body(360, stream=False))
    assert r.status_code == 400
    assert "needs 24 KV blocks" in r.json()["error"]["message"]


async def test_a_stream_that_outgrows_its_prediction_extends_its_lease():
    async with (
        gateway_over([ENGINE], admission=admission("predicted")) as gw,
        httpx.AsyncClient(timeout=30) as http,
    ):
        for _ in range(5):  # learn: outputs of 8 tokens
            r = await http.post(gw.url + "/v1/completions", json=body(8, stream=False))
            assert r.status_code == 200
        worst = math.ceil((10 + 100) / BLOCK)  # 7
        seen = []
        async with http.stream(
            "POST", gw.url + "/v1/completions", json=body(100, stream=True)
        ) as r:
            events = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    events += 1
                    if events in (1, 60):
                        status = await gw.status()
                        seen.append(sum(e["reserved_blocks"] for e in status["engines"]))
        assert events == 100
        # Reserved for the prediction at first (10 + 8 tokens), then grown with the stream:
        # the gateway had relayed at least 60 tokens, so at least ceil(71 / 16) blocks.
        assert seen[0] == math.ceil((10 + 8) / BLOCK)
        assert math.ceil((10 + 60 + 1) / BLOCK) <= seen[1] <= worst
        extended = await metric(http, gw.url, "kv_gateway_extended_blocks_total")
        assert extended == worst - seen[0]  # grown to the worst case by the end
        assert not any(await gw.reserved_blocks_settle())


async def test_each_tenant_is_predicted_from_its_own_outputs():
    """A tenant that answers long is not reserved for by another tenant's short answers,
    and one with too few samples of its own borrows the model's."""
    keys = {name: f"key-{name}" for name in ("short", "long", "new")}
    tenants = [
        {"name": name, "api_keys": [hashlib.sha256(key.encode()).hexdigest()]}
        for name, key in keys.items()
    ]

    def auth(name):
        return {"authorization": f"Bearer {keys[name]}"}

    async with (
        gateway_over([ENGINE], admission=admission("predicted"), tenants=tenants) as gw,
        httpx.AsyncClient(timeout=30) as http,
    ):
        for name, output in (("long", 90), ("short", 8)):  # the short ones come last
            for _ in range(5):
                r = await http.post(
                    gw.url + "/v1/completions", json=body(output, stream=False), headers=auth(name)
                )
                assert r.status_code == 200

        async def reserved(name):
            async with http.stream(
                "POST", gw.url + "/v1/completions", json=body(600, stream=True), headers=auth(name)
            ) as r:
                assert r.status_code == 200
                async for _ in r.aiter_lines():
                    break
                status = await gw.status()
            return sum(e["reserved_blocks"] for e in status["engines"])

        assert await reserved("long") == math.ceil((10 + 90) / BLOCK)  # its own 90
        assert await reserved("short") == math.ceil((10 + 8) / BLOCK)  # its own 8
        # No samples of its own: the model's window (the last 5: all 8 tokens).
        assert await reserved("new") == math.ceil((10 + 8) / BLOCK)


async def test_adaptive_reserves_the_quantile_plus_its_margin_and_shows_it():
    # Outputs of 8 and 40 tokens: the 0.5 quantile is 8 and the mean excess over it 16 (half
    # the samples overshoot by 32). A margin of 2 reserves 8 + 2 × 16 = 40 output tokens.
    steer = {"start_margin": 2, "max_margin": 10, "warmup_requests": 0}
    cfg = {
        "kv_ceiling": 1.0,
        "reservation": "adaptive",
        "prediction": {"quantile": 0.5, "window": 6, "min_samples": 6},
        "adaptive": steer,
    }
    async with (
        gateway_over([ENGINE], admission=cfg) as gw,
        httpx.AsyncClient(timeout=30) as http,
    ):
        for max_tokens in (8, 40) * 3:
            r = await http.post(gw.url + "/v1/completions", json=body(max_tokens, stream=False))
            assert r.status_code == 200
        assert await reserved_while_streaming(http, gw.url, 600) == math.ceil((10 + 40) / BLOCK)
        # Six completed requests and no preemption: 6 × step (0.1) × target (1) / 1000 less.
        margin = 2 - 6 * 0.1 / 1000
        assert await metric(http, gw.url, "kv_gateway_reserved_margin") == pytest.approx(margin)
        assert await metric(http, gw.url, "kv_gateway_reserved_quantile") == 0.5
        status = (await http.get(gw.url + "/admin/status")).json()
        assert status["models"] == [
            {
                "name": "tiny",
                "predicted_output_tokens": 8,
                "reserved_quantile": 0.5,
                "reserved_margin": round(margin, 3),
            }
        ]
