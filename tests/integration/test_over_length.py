"""`admission.over_length`: a max_tokens the context cannot hold after the prompt is clamped
(vLLM 0.32's behaviour, the default) or refused; beyond the whole context, refused."""

import dataclasses

import httpx
import pytest

from tests.integration.conftest import FAST, gateway_over

SIM = dataclasses.replace(FAST, max_model_len=256, num_gpu_blocks=65)


def body(max_tokens: int) -> dict[str, object]:
    return {"model": "tiny", "prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True}


async def test_clamped_by_default_as_the_engine_runs_it() -> None:
    async with gateway_over([SIM]) as gw, httpx.AsyncClient(timeout=30) as http:
        direct = await http.post(gw.engines[0].url + "/v1/completions", json=body(255))
        through = await http.post(gw.url + "/v1/completions", json=body(255))
        assert direct.status_code == through.status_code == 200
        for answer in (direct, through):
            choice, usage = answer.json()["choices"][0], answer.json()["usage"]
            assert choice["finish_reason"] == "length"
            assert usage["prompt_tokens"] + usage["completion_tokens"] == SIM.max_model_len
        # Reserved for the clamped output: the whole context, 16 blocks, on the engine's peak.
        assert gw.engines[0].sim.engine.snapshot().peak_used_blocks <= 16
        too_big = await http.post(gw.url + "/v1/completions", json=body(257))
        assert too_big.status_code == 400
        assert too_big.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("max_tokens", [255, 257])
async def test_refused_when_configured(max_tokens: int) -> None:
    admission = {"over_length": "refuse"}
    async with gateway_over([SIM], admission=admission) as gw, httpx.AsyncClient() as http:
        r = await http.post(gw.url + "/v1/completions", json=body(max_tokens))
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert (await gw.status())["engines"][0]["reserved_blocks"] == 0
