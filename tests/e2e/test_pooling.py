"""The rest of the surface against real vLLM: a pooling engine (the tiny model as an embedding
model: `--runner pooling --convert embed`, which keeps a KV cache for its prompts) behind the
gateway, and the generating engine's `/tokenize`, `/detokenize`, `/version` and
`/v1/responses` through it.

The official `openai` client's `embeddings.create` and `models.retrieve` work through the
gateway; embeddings are admitted by their prompts (the header equals vLLM's
`usage.prompt_tokens`), score and rerank pass through.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e import conftest
from tests.e2e.gateway_process import GatewayProcess, gateway_config, serving_gateway

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def pooling_url(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with conftest.own_engine(
        vllm_model_dir,
        tmp_path_factory.mktemp("vllm-pooling"),
        "pooling engine start",
        extra_args=("--runner", "pooling", "--convert", "embed"),
    ) as url:
        yield url


@pytest.fixture(scope="module")
def pooling_gateway(
    pooling_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    config = gateway_config(pooling_url)
    config["engines"][0]["name"] = "pool0"
    with serving_gateway(config, tmp_path_factory.mktemp("pooling-gateway")) as gw:
        yield gw


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="e2e", max_retries=0, timeout=120)


def test_embeddings_create_through_the_gateway(
    pooling_url: str, pooling_gateway: GatewayProcess
) -> None:
    inputs = ["The quick brown fox.", "KV blocks hold the prompt while it is read."]
    with client(pooling_url) as direct, client(pooling_gateway.url) as through:
        expected = direct.embeddings.create(model="tiny", input=inputs)
        raw = through.embeddings.with_raw_response.create(model="tiny", input=inputs)
        got = raw.parse()
    assert [d.embedding for d in got.data] == [d.embedding for d in expected.data]
    assert got.usage.prompt_tokens == expected.usage.prompt_tokens
    assert int(raw.headers["x-kv-gateway-prompt-tokens"]) == expected.usage.prompt_tokens
    # Two sequences of their prompts alone (no output), one 128-token block each.
    assert int(raw.headers["x-kv-gateway-blocks"]) == 2


def test_models_retrieve_through_the_gateway(pooling_gateway: GatewayProcess) -> None:
    with client(pooling_gateway.url) as through:
        model = through.models.retrieve("tiny")
        assert (model.id, model.object) == ("tiny", "model")
        with pytest.raises(openai.NotFoundError):
            through.models.retrieve("no-such-model")


def test_score_and_rerank_pass_through(pooling_url: str, pooling_gateway: GatewayProcess) -> None:
    bodies = {
        "/score": {"model": "tiny", "queries": "a fox", "documents": ["a dog", "the fox"]},
        "/rerank": {"model": "tiny", "query": "a fox", "documents": ["a dog", "the fox"]},
    }
    with httpx.Client(timeout=60) as http:
        for path, body in bodies.items():
            direct = http.post(f"{pooling_url}{path}", json=body)
            through = http.post(f"{pooling_gateway.url}{path}", json=body)
            assert direct.status_code == through.status_code == 200, (path, through.text)
            scores = "data" if path == "/score" else "results"
            assert through.json()[scores] == direct.json()[scores]
            # Counted as two (query, document) pairs and the query alone: at least vLLM's.
            counted = int(through.headers["x-kv-gateway-prompt-tokens"])
            assert counted >= through.json()["usage"]["prompt_tokens"]


def test_tokenize_detokenize_version_through_the_gateway(
    vllm_url: str, gateway: GatewayProcess
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=60) as http:
        for path, payload in [
            ("/tokenize", body),
            ("/tokenize", {"model": "tiny", "prompt": "x y"}),
        ]:
            direct = http.post(f"{vllm_url}{path}", json=payload)
            through = http.post(f"{gateway.url}{path}", json=payload)
            assert through.status_code == 200, through.text
            assert through.json() == direct.json()
            assert through.headers["x-kv-gateway-blocks"] == "0"  # no KV held
        tokens = direct.json()["tokens"]
        detok = http.post(f"{gateway.url}/detokenize", json={"model": "tiny", "tokens": tokens})
        assert detok.status_code == 200 and detok.json()["prompt"] == "x y"
        version = http.get(f"{gateway.url}/version")
        assert version.status_code == 200 and version.json()["server"] == "kv-gateway"


def test_responses_through_the_gateway(vllm_url: str, gateway: GatewayProcess) -> None:
    with client(gateway.url) as through:
        raw = through.responses.with_raw_response.create(
            model="tiny", input="Name a prime.", max_output_tokens=4
        )
        answer = raw.parse()
    assert answer.id.startswith("resp_")
    assert answer.usage is not None
    # Admitted with the stated footprint: the input rendered as one user message.
    assert int(raw.headers["x-kv-gateway-prompt-tokens"]) == answer.usage.input_tokens
