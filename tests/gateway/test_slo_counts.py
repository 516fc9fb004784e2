"""What the exchange counts per service class (`kv_gateway_slo_requests_total`): a request
with a class is counted `admitted` at its first reservation and `refused` when answered 429
`slo_unattainable`; a request without a class, or refused for another reason, is not."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import pytest

from gateway.core.retry import RetryAdvice
from gateway.core.types import ServiceClass, TenantPolicy
from gateway.errors import GatewayError, RateLimited
from gateway.exchange import Exchanges
from gateway.metrics import SLO_OUTCOMES, SLO_UNATTAINABLE, GatewayMetrics
from gateway.request import Inbound, parse_body
from gateway.service import Service
from tests.gateway.test_exchange import TENANT, Desk, Scripted, body, desk, whole

INTERACTIVE = ServiceClass("interactive", ttft_s=1.0, tpot_s=0.05)
BATCH = ServiceClass("batch")


def counts(metrics: GatewayMetrics) -> dict[tuple[str, str], float]:
    return {
        (labels["class"], labels["outcome"]): value
        for labels, value in metrics.totals()["kv_gateway_slo_requests"]
    }


def classed(raw: bytes, service_class: ServiceClass | None) -> Inbound:
    return dataclasses.replace(parse_body(raw, "completion"), service_class=service_class)


async def serve(d: Desk, inbound: Inbound, raw: bytes) -> None:
    exchange = d.exchanges.start("completion", "req")
    try:
        await exchange.open(TENANT, inbound, raw)
        assert exchange.service_class == inbound.service_class
        async for _ in exchange.relay():
            pass
    finally:
        await exchange.settle()


def test_configured_classes_are_shown_at_zero_and_outcomes_are_checked():
    metrics = GatewayMetrics()
    assert counts(metrics) == {}
    metrics.know_classes(["interactive", "batch"])
    assert counts(metrics) == {(c, o): 0.0 for c in ("interactive", "batch") for o in SLO_OUTCOMES}
    metrics.slo("interactive", "met")
    metrics.slo("unlisted", "missed")  # a class made known late still counts
    assert counts(metrics)["interactive", "met"] == 1
    assert counts(metrics)["unlisted", "missed"] == 1
    with pytest.raises(ValueError, match="outcome"):
        metrics.slo("unlisted", "late")


async def test_a_request_with_a_class_is_counted_admitted_once_for_its_class():
    usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    d = desk({url: Scripted(body=whole(usage)) for url in ("http://a", "http://b")})
    metrics = d.exchanges.metrics
    metrics.know_classes(["interactive", "batch"])
    raw = body()
    await serve(d, classed(raw, INTERACTIVE), raw)
    await serve(d, classed(raw, INTERACTIVE), raw)
    await serve(d, classed(raw, BATCH), raw)
    await serve(d, classed(raw, None), raw)  # no class: counted for none
    got = counts(metrics)
    assert {k: v for k, v in got.items() if v} == {
        ("interactive", "admitted"): 2.0,
        ("batch", "admitted"): 1.0,
    }


class Refusing:
    """A service whose admission refuses every request with `code`."""

    reservation = "worst_case"

    def __init__(self, code: str) -> None:
        self.code = code

    async def admit(self, inbound: Inbound, tenant: TenantPolicy, **_: Any) -> Any:
        raise RateLimited("refused", code=self.code, retry=RetryAdvice(1.0))


@pytest.mark.parametrize(
    ("code", "service_class", "refused"),
    [
        (SLO_UNATTAINABLE, INTERACTIVE, 1.0),
        ("queue_full", INTERACTIVE, 0.0),  # refused, but not for its targets
        (SLO_UNATTAINABLE, None, 0.0),
    ],
)
async def test_a_slo_unattainable_refusal_is_counted_refused_for_the_class(
    code: str, service_class: ServiceClass | None, refused: float
):
    d = desk({})
    metrics = d.exchanges.metrics
    metrics.know_classes(["interactive"])
    refusing = Exchanges(
        service=cast(Service, Refusing(code)),
        upstream=d.engines,
        ejector=d.exchanges.ejector,
        pool=d.pool,
        metrics=metrics,
    )
    exchange = refusing.start("completion", "req")
    raw = body()
    with pytest.raises(RateLimited):
        try:
            await exchange.open(TENANT, classed(raw, service_class), raw)
        except GatewayError as e:
            exchange.fail(e)
            raise
        finally:
            await exchange.settle()
    assert counts(metrics)["interactive", "refused"] == refused
    assert counts(metrics)["interactive", "admitted"] == 0
    refusals = metrics.totals()["kv_gateway_tenant_refusals"]
    assert refusals == [({"tenant": TENANT.name, "reason": code}, 1.0)]
