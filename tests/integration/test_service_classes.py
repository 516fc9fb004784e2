"""Service classes over real sockets, with the official `openai` client: a request's class is
its tenant's, or the one it names in the class header if its tenant may use it (else a 400
`invalid_service_class`); `/metrics` and `/admin/status` show the classes, their targets and
what became of their requests; a reload takes new classes."""

import httpx
import openai
import pytest

from gateway.config import parse_config
from tests.admin import ADMIN_HEADERS, with_admin
from tests.integration.conftest import gateway_over
from tests.integration.test_dashboard import samples, validate
from tests.integration.test_tenants import ENGINE, tenant

HEADER = "x-kv-gateway-service-class"
SLO = {
    "classes": {"interactive": {"ttft_s": 1.0, "tpot_s": 0.05}, "batch": {}},
}
TENANTS = [
    tenant("chat", service_class="interactive", service_classes=["batch"]),
    tenant("jobs", service_class="batch"),
    tenant("plain"),
]


COUNTED = [
    ("interactive", "admitted"),
    ("interactive", "refused"),
    ("batch", "admitted"),
    ("batch", "refused"),
    ("batch", "met"),  # no targets: never judged
    ("batch", "missed"),
]
EXPECTED = [2, 0, 3, 0, 0, 0]


def client(url: str, name: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=f"key-{name}", max_retries=0)


async def complete(url: str, name: str, named: str | None = None) -> None:
    extra = {HEADER: named} if named is not None else None
    async with client(url, name) as openai_client:
        answer = await openai_client.completions.create(
            model="tiny", prompt="hello", max_tokens=3, extra_headers=extra
        )
    assert answer.usage is not None and answer.usage.completion_tokens == 3


async def test_the_header_picks_one_of_the_tenants_classes_and_the_counts_show_it():
    async with (
        gateway_over([ENGINE], tenants=TENANTS, slo=SLO) as gw,
        httpx.AsyncClient(timeout=30) as http,
    ):
        before = await gw.status()
        validate(before)
        assert before["slo"] == {
            "header": HEADER,
            "default_class": None,
            "classes": [
                {
                    "name": "interactive",
                    "ttft_s": 1.0,
                    "tpot_s": 0.05,
                    "requests": {"admitted": 0, "refused": 0, "met": 0, "missed": 0},
                },
                {
                    "name": "batch",
                    "ttft_s": None,
                    "tpot_s": None,
                    "requests": {"admitted": 0, "refused": 0, "met": 0, "missed": 0},
                },
            ],
        }
        shown = {t["name"]: (t["service_class"], t["service_classes"]) for t in before["tenants"]}
        assert shown == {
            "chat": ("interactive", ["interactive", "batch"]),
            "jobs": ("batch", ["batch"]),
            "plain": (None, []),
        }

        await complete(gw.url, "chat")  # its own: interactive
        await complete(gw.url, "chat", "batch")  # one it may name
        await complete(gw.url, "chat", "interactive")
        await complete(gw.url, "jobs")
        await complete(gw.url, "plain")  # no class: counted for none
        chat = await http.post(  # the chat endpoint reads the header as well
            gw.url + "/v1/chat/completions",
            headers={"authorization": "Bearer key-chat", HEADER: "batch"},
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
        )
        assert chat.status_code == 200

        refused = [("jobs", "interactive"), ("plain", "batch"), ("chat", "gold"), ("chat", "")]
        for name, named in refused:
            with pytest.raises(openai.BadRequestError) as err:
                await complete(gw.url, name, named)
            assert err.value.status_code == 400
            assert err.value.code == "invalid_service_class"
            assert err.value.type == "invalid_request_error"
            assert HEADER in err.value.message
        assert "it may use: batch." in _message(await _ask(http, gw.url, "jobs", "interactive"))
        assert "it may use: none." in _message(await _ask(http, gw.url, "plain", "batch"))
        listed = _message(await _ask(http, gw.url, "chat", "gold"))
        assert "it may use: batch, interactive." in listed

        # Admitted and refused as counted here; met and missed are judged when an answer
        # ends (by the latency book), best-effort classes never.
        page = (await http.get(gw.url + "/metrics", headers=ADMIN_HEADERS)).text
        slo = samples(page, "kv_gateway_slo_requests_total")
        assert set(slo) == {
            frozenset({("class", c), ("outcome", o)})
            for c in ("interactive", "batch")
            for o in ("admitted", "refused", "met", "missed")
        }
        counted = [slo[frozenset({("class", c), ("outcome", o)})] for c, o in COUNTED]
        assert counted == EXPECTED
        after = await gw.status()
        validate(after)
        requests = {c["name"]: c["requests"] for c in after["slo"]["classes"]}
        assert [requests[c][o] for c, o in COUNTED] == EXPECTED
        assert requests["interactive"]["met"] + requests["interactive"]["missed"] <= 2
        # The 400s were answered as the tenants' requests, under their code; none reserved.
        assert after["traffic"]["requests"]["invalid_service_class"] == len(refused) + 3
        assert all(e["reserved_blocks"] == 0 for e in after["engines"])


async def test_without_tenants_the_default_class_applies_and_any_class_may_be_named():
    slo = {**SLO, "default_class": "batch", "header": "X-Class"}
    async with (
        gateway_over([ENGINE], slo=slo) as gw,
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as anyone,
    ):
        await anyone.completions.create(model="tiny", prompt="a", max_tokens=2)
        await anyone.completions.create(
            model="tiny", prompt="a", max_tokens=2, extra_headers={"x-class": "interactive"}
        )
        with pytest.raises(openai.BadRequestError) as err:
            await anyone.completions.create(
                model="tiny", prompt="a", max_tokens=2, extra_headers={"X-Class": "gold"}
            )
        assert err.value.code == "invalid_service_class"
        assert "it may use: batch, interactive." in err.value.message
        status = await gw.status()
        validate(status)
        assert status["slo"]["header"] == "x-class"
        assert status["slo"]["default_class"] == "batch"
        assert [(t["name"], t["service_class"]) for t in status["tenants"]] == [
            ("default", "batch")
        ]
        admitted = {c["name"]: c["requests"]["admitted"] for c in status["slo"]["classes"]}
        assert admitted == {"interactive": 1, "batch": 1}


async def test_a_reload_takes_new_classes_and_step_costs_need_a_restart():
    async with gateway_over([ENGINE], tenants=TENANTS, slo=SLO) as gw:
        raw = {
            "engines": [{"name": "e0", "url": gw.engines[0].url, "max_num_seqs": 64}],
            "models": [{"name": "tiny", "tokenizer": "hf:@tiny"}],
            "routing": {"seed": 7},
            "tenants": [tenant("jobs", service_class="batch", service_classes=["premium"])],
            "slo": {**SLO, "classes": {**SLO["classes"], "premium": {"ttft_s": 0.5}}},
        }
        assert gw.runtime.reload_keys(parse_config(with_admin(raw))) == []
        await complete(gw.url, "jobs", "premium")
        status = await gw.status()
        validate(status)
        (premium,) = [c for c in status["slo"]["classes"] if c["name"] == "premium"]
        assert (premium["ttft_s"], premium["tpot_s"]) == (0.5, None)
        assert (premium["requests"]["admitted"], premium["requests"]["refused"]) == (1, 0)
        assert [t["service_classes"] for t in status["tenants"]] == [["batch", "premium"]]

        costs = {**raw, "slo": {**raw["slo"], "step_costs": {"base_ms": 3}}}
        assert gw.runtime.reload_keys(parse_config(with_admin(costs))) == ["slo"]
        assert gw.runtime.cfg.slo.step_costs.base_ms == 10  # as it started


async def _ask(http: httpx.AsyncClient, url: str, name: str, named: str) -> httpx.Response:
    return await http.post(
        url + "/v1/completions",
        headers={"authorization": f"Bearer key-{name}", HEADER: named},
        json={"model": "tiny", "prompt": "hello", "max_tokens": 3},
    )


def _message(response: httpx.Response) -> str:
    assert response.status_code == 400
    message: str = response.json()["error"]["message"]
    return message
