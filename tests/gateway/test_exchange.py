"""The exchange's policies without sockets: failover, ejection, refund, learning, release.

The engines are scripted `Upstream`s (the seam `gateway.proxy.Upstream` fills in production);
everything else is the real thing: the in-process store, the scheduler, the service, the
engine pool and monitor, the metrics.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest

from gateway.config import HealthConfig
from gateway.core.reservation import AdaptivePolicy, AdaptiveReservation
from gateway.core.retry import ReleaseRate
from gateway.core.routing import Router
from gateway.core.types import EngineSpec, TenantPolicy
from gateway.engines.monitor import EngineMonitor
from gateway.engines.pool import EnginePool
from gateway.errors import GatewayError, RateLimited, UpstreamUnavailable
from gateway.exchange import MIN_ENGINE_REFUSALS, Exchange, Exchanges, tokens_used
from gateway.metrics import GatewayMetrics
from gateway.request import parse_body
from gateway.scheduler import Scheduler
from gateway.service import Service
from gateway.state.errors import StateUnavailable
from gateway.state.memory import InMemoryStore
from gateway.state.totals import StoreTotals
from gateway.tokens import make_counter

MODEL = "m"
TPM = 10_000
TENANT = TenantPolicy("t", tpm=TPM)


@dataclass
class Scripted:
    """One engine's answer: `status` with `body` (its chunks), unreachable, or broken off."""

    status: int = 200
    body: list[bytes] = field(default_factory=list)
    unreachable: bool = False
    breaks_after: int | None = None  # chunks delivered before the answer breaks off
    closed: bool = False

    @property
    def status_code(self) -> int:
        return self.status

    @property
    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"content-type", b"application/json"), (b"server", b"engine")]

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    async def chunks(self) -> AsyncIterator[bytes]:
        for i, chunk in enumerate(self.body):
            if self.breaks_after is not None and i >= self.breaks_after:
                raise UpstreamUnavailable("the engine's answer broke off: ServerDisconnected")
            yield chunk

    async def aclose(self) -> None:
        self.closed = True


@dataclass
class Engines:
    """The scripted `Upstream`: answers by engine URL, and records what was sent where."""

    answers: dict[str, Scripted]
    sent: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)

    async def open(
        self, base_url: str, path: str, body: bytes, headers: dict[str, str], *, streaming: bool
    ) -> Scripted:
        self.sent.append((base_url, path, headers))
        answer = self.answers[base_url]
        if answer.unreachable:
            raise UpstreamUnavailable(f"the engine at {base_url} could not be reached")
        return answer


def whole(usage: dict[str, int] | None = None) -> list[bytes]:
    body: dict[str, object] = {"choices": [{"index": 0, "text": "hi"}]}
    if usage is not None:
        body["usage"] = usage
    return [json.dumps(body).encode()]


@dataclass
class Desk:
    exchanges: Exchanges
    store: InMemoryStore
    pool: EnginePool
    engines: Engines
    service: Service

    async def remaining_tokens(self) -> int | None:
        return (await self.store.rate_limits(TENANT)).remaining_tokens


def desk(answers: dict[str, Scripted]) -> Desk:
    # "a" has the most free blocks: every first admission picks it.
    specs = [
        EngineSpec(name, url, frozenset({MODEL}), blocks, 16, 64, 2048)
        for name, url, blocks in (("a", "http://a", 2049), ("b", "http://b", 1025))
    ]
    pool = EnginePool(specs)
    # The store's clock stands still: a token bucket refilling between a charge and the
    # reading of it (one token per 6 ms at this TPM) would make the exact counts below racy.
    store = InMemoryStore(Router(["most_free_blocks"]), random.Random(0), clock=lambda: 1000.0)
    scheduler = Scheduler(
        store=store,
        pool=pool,
        kv_ceiling=1.0,
        max_length=8,
        max_wait_s=1.0,
        retry_fallback_s=1.0,
        rate=ReleaseRate(),
    )
    service = Service(
        pool=pool,
        scheduler=scheduler,
        counters={MODEL: make_counter("estimate", model=MODEL)},
        kv_ceiling=1.0,
    )
    monitor = EngineMonitor(pool, httpx.AsyncClient(), HealthConfig())
    engines = Engines(answers)
    suffixes = (f"s{i}" for i in itertools.count(1))
    exchanges = Exchanges(
        service=service,
        upstream=engines,
        ejector=monitor,
        pool=pool,
        metrics=GatewayMetrics(),
        suffix=lambda: next(suffixes),
    )
    return Desk(exchanges, store, pool, engines, service)


def body(max_tokens: int = 100, *, stream: bool = False) -> bytes:
    raw = {"model": MODEL, "prompt": "hello there", "max_tokens": max_tokens, "stream": stream}
    return json.dumps(raw).encode()


async def run(exchange: Exchange, raw: bytes, *, read: int | None = None) -> list[bytes]:
    """Open, relay (all chunks, or the first `read`: then the client leaves), settle."""
    got: list[bytes] = []
    try:
        await exchange.open(TENANT, parse_body(raw, "completion"), raw)
        async for chunk in exchange.relay():
            got.append(chunk)
            if read is not None and len(got) >= read:
                break
    except GatewayError as e:
        exchange.fail(e)
        raise
    finally:
        await exchange.settle()
    return got


async def assert_nothing_held(d: Desk) -> None:
    assert await d.store.totals() == StoreTotals()


def test_the_refund_rule() -> None:
    assert tokens_used(nothing_generated=True, metered=50) == 0
    assert tokens_used(nothing_generated=False, metered=50) == 50
    assert tokens_used(nothing_generated=False, metered=None) is None  # the charge is kept


async def test_fails_over_once_before_the_first_byte_and_ejects_the_engine() -> None:
    answer = whole({"total_tokens": 30, "completion_tokens": 2})
    d = desk({"http://a": Scripted(unreachable=True), "http://b": Scripted(body=answer)})
    exchange = d.exchanges.start("completion", "req-1")
    assert await run(exchange, body()) == answer
    assert [url for url, _, _ in d.engines.sent] == ["http://a", "http://b"]
    # Each attempt reaches its engine under an id of its own.
    assert [h["x-request-id"] for _, _, h in d.engines.sent] == ["req-1-s1", "req-1-s2"]
    state_a = d.pool.get("a")
    assert state_a is not None and not state_a.healthy
    assert "could not be reached" in (state_a.last_error or "")
    # Charged once: the failed-over lease was released with its tokens back.
    assert await d.remaining_tokens() == TPM - 30
    await assert_nothing_held(d)


async def test_unreachable_everywhere_refunds_the_whole_charge() -> None:
    d = desk({"http://a": Scripted(unreachable=True), "http://b": Scripted(unreachable=True)})
    exchange = d.exchanges.start("completion", "req-1")
    with pytest.raises(UpstreamUnavailable):
        await run(exchange, body())
    assert len(d.engines.sent) == 2  # once, then once more elsewhere: never a third time
    assert await d.remaining_tokens() == TPM
    assert exchange.outcome == "upstream_unavailable"
    await assert_nothing_held(d)


async def test_no_failover_once_the_answer_started() -> None:
    chunks = [b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'] * 3
    d = desk({url: Scripted(body=chunks, breaks_after=2) for url in ("http://a", "http://b")})
    exchange = d.exchanges.start("completion", "req-1")
    with pytest.raises(UpstreamUnavailable):
        await run(exchange, body(stream=True))
    assert [url for url, _, _ in d.engines.sent] == ["http://a"]
    engine = d.pool.get("a")
    assert engine is not None and engine.healthy  # a broken answer is not an unreachable engine
    # The engine generated tokens: the stream's prompt and two events stay charged.
    remaining = await d.remaining_tokens()
    assert remaining is not None and remaining < TPM
    await assert_nothing_held(d)


@pytest.mark.parametrize("status", [400, 422])
async def test_an_error_answer_is_relayed_and_refunds_the_whole_charge(status: int) -> None:
    error = [b'{"error": {"message": "bad", "code": 400}}']
    d = desk({url: Scripted(status=status, body=error) for url in ("http://a", "http://b")})
    exchange = d.exchanges.start("completion", "req-1")
    assert await run(exchange, body()) == error
    assert exchange.outcome == str(status)
    assert await d.remaining_tokens() == TPM
    assert not d.service.output_lengths[MODEL]  # an error teaches nothing
    await assert_nothing_held(d)


async def test_an_engine_failure_answer_is_a_502_and_refunds() -> None:
    d = desk({url: Scripted(status=500, body=[b"boom"]) for url in ("http://a", "http://b")})
    exchange = d.exchanges.start("completion", "req-1")
    with pytest.raises(UpstreamUnavailable, match="answered 500: boom"):
        await run(exchange, body())
    assert d.engines.answers["http://a"].closed
    assert await d.remaining_tokens() == TPM
    await assert_nothing_held(d)


async def test_a_client_gone_before_a_whole_answer_keeps_the_charge() -> None:
    chunks = [b'{"choices": [{"index": 0, "text": "hi"}], ', b'"usage": {"total_tokens": 9}}']
    d = desk({url: Scripted(body=chunks) for url in ("http://a", "http://b")})
    exchange = d.exchanges.start("completion", "req-1")
    await run(exchange, body(max_tokens=100), read=1)
    remaining = await d.remaining_tokens()
    # The whole worst case (prompt + 100) stays charged: the engine may have generated it.
    assert remaining is not None and remaining <= TPM - 100
    assert not d.service.output_lengths[MODEL]  # nothing learned from a partial answer
    await assert_nothing_held(d)


async def test_a_whole_answer_charges_its_usage_and_teaches_its_length() -> None:
    usage = {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}
    d = desk({url: Scripted(body=whole(usage)) for url in ("http://a", "http://b")})
    exchange = d.exchanges.start("completion", "req-1")
    await run(exchange, body())
    assert await d.remaining_tokens() == TPM - 11
    assert len(d.service.output_lengths[MODEL]) == 1
    assert exchange.outcome == "200"
    sent_headers = d.engines.sent[0][2]
    assert sent_headers["x-request-id"] == "req-1-s1"  # ours, plus a suffix of its own
    await assert_nothing_held(d)


async def test_settle_releases_when_admission_never_happened() -> None:
    d = desk({})
    exchange = d.exchanges.start("completion", "req-1")
    exchange.fail(GatewayError("auth failed before anything", code="invalid_api_key"))
    await exchange.settle()
    assert exchange.outcome == "invalid_api_key"
    await assert_nothing_held(d)


async def test_rate_limits_are_left_out_when_the_store_cannot_say() -> None:
    d = desk({})

    async def down(tenant: TenantPolicy) -> None:
        raise StateUnavailable("redis unreachable")

    d.store.rate_limits = down  # type: ignore[method-assign,assignment]
    exchange = d.exchanges.start("completion", "req-1")
    exchange.tenant = TENANT
    assert await exchange.rate_limits() is None


async def test_an_engine_full_at_its_front_door_is_passed_over_not_failed() -> None:
    full = [b'{"error": {"message": "busy", "type": "Service Unavailable", "code": 503}}']
    answer = whole({"total_tokens": 12, "completion_tokens": 2})
    d = desk({"http://a": Scripted(status=503, body=full), "http://b": Scripted(body=answer)})
    exchange = d.exchanges.start("completion", "req-1")
    assert await run(exchange, body()) == answer
    assert [url for url, _, _ in d.engines.sent] == ["http://a", "http://b"]
    state_a = d.pool.get("a")
    assert state_a is not None and state_a.healthy  # full, not broken
    assert await d.remaining_tokens() == TPM - 12  # charged once
    await assert_nothing_held(d)


async def test_refused_everywhere_again_and_again_is_a_429_not_a_503() -> None:
    full = [b'{"error": {"message": "busy", "type": "Service Unavailable", "code": 503}}']
    d = desk({url: Scripted(status=503, body=full) for url in ("http://a", "http://b")})
    exchange = d.exchanges.start("completion", "req-1")
    with pytest.raises(RateLimited) as refused:
        await run(exchange, body())
    assert refused.value.code == "engine_full"
    # The queue's patience (1 s here) ran out before the 8th refusal: 2 engines, 0.5 s apart.
    assert len(d.engines.sent) == MIN_ENGINE_REFUSALS
    assert await d.remaining_tokens() == TPM
    await assert_nothing_held(d)


@dataclass
class RefusingFirst(Engines):
    """Refuses the first `refusals` requests at the front door, then answers."""

    refusals: int = 0

    async def open(
        self, base_url: str, path: str, body: bytes, headers: dict[str, str], *, streaming: bool
    ) -> Scripted:
        answer = await super().open(base_url, path, body, headers, streaming=streaming)
        if len(self.sent) <= self.refusals:
            return Scripted(status=503, body=[b'{"error": {"message": "busy"}}'])
        return answer


async def test_refusals_are_waited_out_while_the_request_is_younger_than_the_queue_patience(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A burst refused and retried together: one request may lose the door more than 8 times
    # while the others are served. It is not the client's error before max_wait_s.
    monkeypatch.setattr("gateway.exchange.ENGINE_FULL_HOLD_S", 0.05)
    answer = whole({"total_tokens": 12, "completion_tokens": 2})
    d = desk({url: Scripted(body=answer) for url in ("http://a", "http://b")})
    engines = RefusingFirst(d.engines.answers, refusals=MIN_ENGINE_REFUSALS + 3)
    d.exchanges.upstream = engines
    d.service.scheduler.max_wait_s = 30.0
    exchange = d.exchanges.start("completion", "req-1")
    assert await run(exchange, body()) == answer
    assert len(engines.sent) == MIN_ENGINE_REFUSALS + 4
    assert await d.remaining_tokens() == TPM - 12  # charged once
    await assert_nothing_held(d)


async def test_adaptive_reservations_follow_the_engines_preemptions() -> None:
    usage = {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}
    d = desk({url: Scripted(body=whole(usage)) for url in ("http://a", "http://b")})
    service = d.service
    service.reservation = "adaptive"
    # Steers after its first two completed requests: preemptions before are not owed.
    steer = service.adaptive[MODEL] = AdaptiveReservation(AdaptivePolicy(warmup_requests=2), 0.9)
    start = steer.margin
    state = d.pool.get("a")
    assert state is not None
    state.preemptions = 0
    await run(d.exchanges.start("completion", "r0"), body())  # the counter's first reading
    state.preemptions = 5  # the cold start's preemptions
    await run(d.exchanges.start("completion", "r1"), body())
    assert steer.margin == start  # still warming up
    state.preemptions = 8  # the engine preempted three times since
    await run(d.exchanges.start("completion", "r2"), body())
    assert steer.margin == pytest.approx(start + 3 * steer.policy.step - steer.policy.step / 1000)
    # Once enough outputs are known, the cap is their quantile plus the margin's excess.
    pooled = service.output_lengths[MODEL]
    for tokens in [7] * 45 + [70] * 5:
        pooled.observe(tokens)
    quantile = pooled.predicted()
    assert quantile == 7
    assert service.output_cap(MODEL) == quantile + math.ceil(steer.margin * pooled.excess()) > 7
    await assert_nothing_held(d)


def responses_body(previous: str | None = None) -> bytes:
    raw: dict[str, object] = {"model": MODEL, "input": "and then?", "max_output_tokens": 20}
    if previous is not None:
        raw["previous_response_id"] = previous
    return json.dumps(raw).encode()


async def respond(d: Desk, raw: bytes) -> tuple[str, int]:
    """One Responses request; the engine it went to and the prompt tokens it was counted at."""
    exchange = d.exchanges.start("responses", "r", "/v1/responses")
    try:
        answer = await exchange.open(TENANT, parse_body(raw, "responses"), raw)
        async for _ in exchange.relay():
            pass
    finally:
        await exchange.settle()
    return answer.engine, answer.prompt_tokens


async def test_previous_response_id_goes_back_to_the_engine_that_stored_it() -> None:
    stored = {"id": "resp_abc", "object": "response", "usage": {"total_tokens": 321}}
    answers = {
        "http://a": Scripted(200, [json.dumps(stored).encode()]),
        "http://b": Scripted(200, [json.dumps({**stored, "id": "resp_xyz"}).encode()]),
    }
    d = desk(answers)
    first, counted = await respond(d, responses_body())
    assert first == "a" and d.engines.sent[-1][1] == "/v1/responses"
    again, with_history = await respond(d, responses_body("resp_abc"))
    assert again == "a"
    # The stored conversation the engine prepends counts: that response's total tokens.
    assert with_history == counted + 321
    # An id the gateway never saw is routed as any request, and counted without history.
    _, unknown = await respond(d, responses_body("resp_never_seen"))
    assert unknown == counted
    await assert_nothing_held(d)


async def test_a_stored_response_pins_even_when_another_engine_has_more_room() -> None:
    d = desk(
        {
            "http://a": Scripted(200, [b'{"id": "resp_on_a", "usage": {"total_tokens": 5}}']),
            "http://b": Scripted(200, [b'{"id": "resp_on_b", "usage": {"total_tokens": 5}}']),
        }
    )
    d.service.responses.remember("resp_on_b", "b", 5)
    engine, _ = await respond(d, responses_body("resp_on_b"))
    assert engine == "b"  # "a" has twice the free blocks, "b" holds the response
