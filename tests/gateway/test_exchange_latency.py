"""The exchange feeds the latency book and judges service classes' targets (issue 40).

The engines are scripted answers that move a shared clock as their chunks arrive; the rest
is the real exchange, service, scheduler, store and pool (`tests/gateway/test_exchange.py`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from gateway.core.latency import BatchSnapshot, LatencyModels, StepCosts
from gateway.core.types import ServiceClass
from gateway.errors import GatewayError, UpstreamUnavailable
from gateway.exchange import Exchange
from gateway.latency import LatencyBook
from gateway.request import parse_body
from tests.gateway.test_exchange import TENANT, Desk, Scripted, desk

COSTS = StepCosts(0.010, 0.001, 0.0001, chunk_tokens=512, overhead_s=0.005)
INTERACTIVE = ServiceClass("interactive", ttft_s=1.0, tpot_s=0.05)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Timed(Scripted):
    """A 200 answer whose chunks arrive `first_s`, then `gap_s` apart, on `clock`; `during`
    is called before the first chunk is delivered (the engine has the request then)."""

    clock: Clock = field(default_factory=Clock)
    first_s: float = 0.1
    gap_s: float = 0.01
    during: Callable[[], None] | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        for i, chunk in enumerate(self.body):
            if self.breaks_after is not None and i >= self.breaks_after:
                raise UpstreamUnavailable("the engine's answer broke off: ServerDisconnected")
            if i == 0 and self.during is not None:
                self.during()
            self.clock.now += self.first_s if i == 0 else self.gap_s
            yield chunk


def sse(tokens: int) -> list[bytes]:
    events = [f'data: {{"choices":[{{"index":0,"text":"t{i}"}}]}}\n\n' for i in range(tokens)]
    return [e.encode() for e in events] + [b"data: [DONE]\n\n"]


def whole(completion_tokens: int) -> list[bytes]:
    usage = {"prompt_tokens": 3, "completion_tokens": completion_tokens, "total_tokens": 9}
    return [json.dumps({"choices": [{"index": 0, "text": "hi"}], "usage": usage}).encode()]


def timed_desk(answers: dict[str, Scripted], clock: Clock) -> tuple[Desk, LatencyBook]:
    d = desk(answers)
    book = LatencyBook(LatencyModels(COSTS), d.pool, clock=clock)
    d.exchanges.latency = d.service.latency = book
    d.exchanges.clock = clock
    return d, book


async def run(
    exchange: Exchange,
    *,
    stream: bool = True,
    service_class: ServiceClass | None = INTERACTIVE,
    read: int | None = None,
) -> list[bytes]:
    raw = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 50, "stream": stream})
    inbound = dataclasses.replace(
        parse_body(raw.encode(), "completion"), service_class=service_class
    )
    got: list[bytes] = []
    try:
        await exchange.open(TENANT, inbound, raw.encode())
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


def slo(d: Desk, outcome: str, name: str = "interactive") -> float:
    value = d.exchanges.metrics.registry.get_sample_value(
        "kv_gateway_slo_requests_total", {"class": name, "outcome": outcome}
    )
    return value or 0.0


def assert_book_empty(book: LatencyBook, *engines: str) -> None:
    for engine in engines:
        assert book.snapshot(engine) == BatchSnapshot(0, (), book.snapshot(engine).prefill_per_step)
        assert book.tightest_tpot(engine) is None


async def test_a_streamed_answer_is_followed_observed_and_met() -> None:
    clock = Clock()
    seen: list[BatchSnapshot] = []
    answer = Timed(body=sse(10), clock=clock, first_s=0.2, gap_s=0.02)
    d, book = timed_desk({"http://a": answer, "http://b": Scripted()}, clock)
    answer.during = lambda: seen.append(book.snapshot("a"))
    await run(d.exchanges.start("completion", "r1"))
    # While the engine had it: one prefill ahead (the prompt's tokens), its TPOT target.
    assert len(seen) == 1 and len(seen[0].prefills_ahead) == 1 and seen[0].decoding == 0
    # Its TTFT and its decode were observed; then nothing is left of it.
    assert book.models.calibrator("a").observations == 2
    assert_book_empty(book, "a", "b")
    assert (slo(d, "met"), slo(d, "missed")) == (1, 0)


async def test_a_first_token_later_than_the_target_is_missed() -> None:
    clock = Clock()
    d, _ = timed_desk({"http://a": Timed(body=sse(5), clock=clock, first_s=1.5)}, clock)
    await run(d.exchanges.start("completion", "r1"))
    assert (slo(d, "met"), slo(d, "missed")) == (0, 1)


async def test_a_stream_slower_than_its_tpot_target_is_missed() -> None:
    clock = Clock()
    # 5 tokens: 4 gaps of 0.1 s (and the [DONE] event's): TPOT 0.125 s > 0.05 s.
    d, _ = timed_desk({"http://a": Timed(body=sse(5), clock=clock, gap_s=0.1)}, clock)
    await run(d.exchanges.start("completion", "r1"))
    assert (slo(d, "met"), slo(d, "missed")) == (0, 1)


async def test_one_output_token_is_judged_by_its_ttft_alone() -> None:
    clock = Clock()
    d, _ = timed_desk({"http://a": Timed(body=sse(1), clock=clock, gap_s=5.0)}, clock)
    await run(d.exchanges.start("completion", "r1"))
    assert (slo(d, "met"), slo(d, "missed")) == (1, 0)


async def test_a_class_without_targets_and_no_class_are_not_judged() -> None:
    clock = Clock()
    d, book = timed_desk({"http://a": Timed(body=sse(5), clock=clock, first_s=9.0)}, clock)
    await run(d.exchanges.start("completion", "r1"), service_class=ServiceClass("batch"))
    await run(d.exchanges.start("completion", "r2"), service_class=None)
    for name in ("batch", "interactive"):
        assert (slo(d, "met", name), slo(d, "missed", name)) == (0, 0)
    assert book.models.calibrator("a").observations == 4  # still observed
    assert_book_empty(book, "a")


async def test_a_stream_the_client_cuts_counts_as_neither_and_is_dropped() -> None:
    clock = Clock()
    d, book = timed_desk({"http://a": Timed(body=sse(10), clock=clock)}, clock)
    await run(d.exchanges.start("completion", "r1"), read=3)
    assert (slo(d, "met"), slo(d, "missed")) == (0, 0)
    assert book.models.calibrator("a").observations == 1  # its TTFT, not its decode
    assert_book_empty(book, "a")


async def test_a_whole_answer_is_one_observation_and_judged_by_its_arrival() -> None:
    clock = Clock()
    answer = Timed(body=whole(8), clock=clock, first_s=0.4)
    d, book = timed_desk({"http://a": answer}, clock)
    await run(d.exchanges.start("completion", "r1"), stream=False)
    assert book.models.calibrator("a").observations == 1
    assert (slo(d, "met"), slo(d, "missed")) == (1, 0)
    late = Timed(body=whole(8), clock=clock, first_s=1.4)
    d.engines.answers["http://a"] = late
    await run(d.exchanges.start("completion", "r2"), stream=False)
    assert (slo(d, "met"), slo(d, "missed")) == (1, 1)
    assert_book_empty(book, "a")


async def test_failover_drops_the_first_engines_handle() -> None:
    clock = Clock()
    answer = Timed(body=sse(4), clock=clock)
    d, book = timed_desk({"http://a": Scripted(unreachable=True), "http://b": answer}, clock)
    seen: list[tuple[BatchSnapshot, BatchSnapshot]] = []
    answer.during = lambda: seen.append((book.snapshot("a"), book.snapshot("b")))
    await run(d.exchanges.start("completion", "r1"))
    on_a, on_b = seen[0]
    assert on_a.prefills_ahead == () and len(on_b.prefills_ahead) == 1
    assert_book_empty(book, "a", "b")
    assert slo(d, "met") == 1


async def test_an_engine_error_is_dropped_and_not_judged() -> None:
    clock = Clock()
    d, book = timed_desk({"http://a": Scripted(status=400, body=[b'{"error": {}}'])}, clock)
    await run(d.exchanges.start("completion", "r1"))
    assert (slo(d, "met"), slo(d, "missed")) == (0, 0)
    assert book.models.calibrator("a").observations == 0
    assert_book_empty(book, "a")


async def test_an_answer_that_breaks_off_is_dropped() -> None:
    clock = Clock()
    d, book = timed_desk({"http://a": Timed(body=sse(6), clock=clock, breaks_after=2)}, clock)
    with pytest.raises(GatewayError):
        await run(d.exchanges.start("completion", "r1"))
    assert (slo(d, "met"), slo(d, "missed")) == (0, 0)
    assert book.models.calibrator("a").observations == 1  # its TTFT only
    assert_book_empty(book, "a")


async def test_without_a_book_nothing_is_timed() -> None:
    clock = Clock()
    d = desk({"http://a": Timed(body=sse(3), clock=clock)})
    exchange = d.exchanges.start("completion", "r1")
    await run(exchange)
    assert exchange._sent is None and exchange._first_token is None
    assert (slo(d, "met"), slo(d, "missed")) == (0, 0)
