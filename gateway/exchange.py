"""One request's life after parsing: admit → open the upstream → relay → settle.

The HTTP edge (`gateway/http/completions.py`) reads the body, authenticates and parses it,
then hands the rest of the request's life to an `Exchange`, and speaks ASGI with what it
gets back:

    exchange = exchanges.start("chat", request_id)
    try:
        answer = await exchange.open(tenant, inbound, body)   # a lease, then the engine's status
        ...send answer.status and answer.headers...
        async for chunk in exchange.relay():                  # progress, top-up, usage meter
            ...send chunk...
    except GatewayError as e:
        exchange.fail(e)                                       # counted under its code
        ...render e...
    finally:
        await exchange.settle()                                # refund, learn, release, count

The policies live here, each testable without sockets: the engine is reached through an
`Upstream` (`gateway.proxy.Upstream` in production), as httpx puts a transport behind its
client.

- **Failover.** A connection failure before any byte of the answer ejects the engine and
  moves the reservation to another engine, once: released first (its tokens back, as the
  engine never saw the request), taken again there, never counted twice.
- **Refund** (`tokens_used`). The tenant's whole token charge comes back when the engine
  provably generated nothing (it could not be reached, or answered an error, whole or
  streamed). Otherwise the charge becomes the usage read from the answer; when that is
  unknown (a client gone before a whole answer arrived, a timeout) the whole charge is kept:
  the engine may have generated all of it, and refunding it would let a tenant pass its TPM
  by giving up on each request.
- **The engine's own refusals.** vLLM can refuse at its front door (`--max-num-queued-reqs`,
  `--max-num-queued-tokens`: 503). That means "this engine is full now", not "the request
  failed": the lease is given back (nothing was generated), the engine is not routed to for a
  moment (`ENGINE_FULL_HOLD_S`, or until one of the gateway's requests on it ends), and the
  request is admitted again — on another engine, or after waiting in the line. Only after
  `MAX_ENGINE_REFUSALS` in a row does the client get a 429 (`engine_full`), never the 503.
- **Learning.** Only a whole 200 answer that reached the client teaches the output length.
- **Release.** Exactly once, in `settle`, shielded from a second cancellation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.core.footprint import output_budget
from gateway.core.latency import request_prefill
from gateway.core.retry import RetryAdvice
from gateway.core.tenants import RateLimitValues
from gateway.core.types import DEFAULT_TENANT, ServiceClass, TenantPolicy
from gateway.engines.pool import EnginePool
from gateway.errors import (
    EndpointNotServed,
    GatewayError,
    ModelNotFound,
    RateLimited,
    UpstreamUnavailable,
)
from gateway.latency import LatencyBook, Sent
from gateway.metrics import REFUSED_STATUSES, SLO_UNATTAINABLE, GatewayMetrics
from gateway.request import Inbound, Kind
from gateway.service import Admitted, Service
from gateway.state.base import Lease
from gateway.stored_responses import response_facts
from gateway.usage import UsageMeter

log = logging.getLogger(__name__)
access_log = logging.getLogger("gateway.access")
"""One line per request as it ends (`--log-format json` shows it; see docs/operations.md)."""

PATHS: dict[Kind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
"""The completions endpoints (the hot path's first two), by kind."""
ROUTES: dict[str, Kind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": "embeddings",
    "/pooling": "pooling",
    "/score": "score",
    "/v1/score": "score",
    "/rerank": "rerank",
    "/v1/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/v1/responses": "responses",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}
"""Every POST path the gateway admits and forwards, with its kind (the engine gets the same
path: vLLM serves each of them when its model does)."""
FACTS_BYTES = 4096  # of a Responses answer, the head (its id) and tail (its usage) kept
UNKNOWN_MODEL = "unknown"
"""The `model` label of requests naming a model no engine serves (a client's string would
otherwise become a metric label forever)."""
PASS_BACK = (b"content-type", b"content-length", b"content-encoding", b"cache-control")
"""Response headers passed from the engine to the client."""
ENGINE_FULL_HOLD_S = 0.5
"""How long an engine that refused at its front door is passed over (unless a request of
the gateway's on it ends first)."""
MIN_ENGINE_REFUSALS = 8
"""Front-door refusals one request takes at least before its client gets a 429 (it takes
more while it is younger than `queue.max_wait_s`: refusals are waited out like the line)."""
MAX_ENGINE_REFUSALS = 32
"""And at most: each re-admission is charged against the tenant's `rpm` again."""


class UpstreamAnswer(Protocol):
    """An engine's answer: status and headers at once, the body as it arrives. `aclose()`
    must follow; errors reading the body are `GatewayError`s (502, 504)."""

    @property
    def status_code(self) -> int: ...

    @property
    def raw_headers(self) -> list[tuple[bytes, bytes]]: ...

    async def read(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class Upstream(Protocol):
    """Sends a request to an engine; raises `UpstreamUnavailable` (502: nothing reached the
    engine) or `UpstreamTimeout` (504)."""

    async def open(
        self, base_url: str, path: str, body: bytes, headers: dict[str, str], *, streaming: bool
    ) -> UpstreamAnswer: ...


class Ejector(Protocol):
    """Takes an engine out of routing (the engine monitor)."""

    def eject(self, name: str, reason: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Answer:
    """What the client is sent first: the engine's status, the headers to pass back, the
    engine that answers, and the tenant's rate limits as this admission left them."""

    status: int
    headers: list[tuple[bytes, bytes]]
    engine: str
    rates: RateLimitValues | None
    prompt_tokens: int = 0
    """The prompt tokens the gateway counted, as vLLM's `usage.prompt_tokens` counts them
    (each prompt once, whatever `n`)."""
    blocks: int = 0
    """The KV blocks the lease reserves (all sequences: `n` × prompts)."""
    credit: int = 0
    """Prompt blocks not in `blocks`: other live leases on the engine hold them (prefix
    caching, `Lease.credit`)."""


def tokens_used(*, nothing_generated: bool, metered: int | None) -> int | None:
    """The refund rule: what the tenant is charged in the end, None = the whole charge (see
    the module docstring)."""
    return 0 if nothing_generated else metered


class Exchanges:
    """Makes an `Exchange` per request; holds what every exchange works with."""

    def __init__(
        self,
        *,
        service: Service,
        upstream: Upstream,
        ejector: Ejector,
        pool: EnginePool,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
        suffix: Callable[[], str] = lambda: uuid.uuid4().hex[:16],
        latency: LatencyBook | None = None,
    ) -> None:
        self.service = service
        self.upstream = upstream
        self.ejector = ejector
        self.pool = pool
        self.metrics = metrics
        # Told when a completion is sent, has its first token and ends (gateway/latency.py);
        # None when no service class has targets: then nothing here is timed.
        self.latency = latency
        self.clock = clock
        self.suffix = suffix

    def start(self, kind: Kind, request_id: str, path: str | None = None) -> Exchange:
        """An exchange for one request of `kind`, forwarded to `path` (default: the kind's
        completions path)."""
        return Exchange(self, kind, request_id, path or PATHS[kind])


class Exchange:
    """One request, from its parsed body to its release. Not reusable."""

    def __init__(self, desk: Exchanges, kind: Kind, request_id: str, path: str) -> None:
        self._desk = desk
        self.kind = kind
        self.path = path
        self.request_id = request_id
        self._head = bytearray()  # a Responses answer's first and last bytes (its id, usage)
        self._tail = b""
        self.arrived = desk.clock()
        self.tenant: TenantPolicy = DEFAULT_TENANT
        self.model = ""
        self.streaming = False
        self.outcome = "cancelled"  # until the answer starts or an error is counted
        self._identified = False  # the tenant is known (counted per tenant then)
        self._in_flight = False  # counted in the tenant's in-flight gauge
        self._refused: str | None = None  # the code of a 429/503 the gateway answered
        self._waited: float | None = None  # arrival → a lease, seconds
        self._first_byte: float | None = None  # arrival → the answer's first byte sent
        self.lease: Lease | None = None
        self._inbound: Inbound | None = None
        self._admitted: Admitted | None = None
        self._response: UpstreamAnswer | None = None
        self._meter: UsageMeter | None = None
        self._completed = False  # the engine's whole 200 answer reached the client
        # Provably no tokens generated: the engine could not be reached, or answered an error.
        self._nothing_generated = False
        self._sent: Sent | None = None  # the latency book's handle, while an engine has it
        self._first_token: float | None = None  # when its first token arrived (timed only)

    @property
    def service_class(self) -> ServiceClass | None:
        """The latency contract the request is held to (None: none, or not opened yet)."""
        return None if self._inbound is None else self._inbound.service_class

    def identify(self, tenant: TenantPolicy) -> None:
        """The request's tenant, once its key is checked: from here on it is counted as the
        tenant's (a request refused before, e.g. for a wrong key, belongs to no tenant)."""
        self.tenant, self._identified = tenant, True

    async def open(self, tenant: TenantPolicy, inbound: Inbound, body: bytes) -> Answer:
        """Reserve (waiting in line if need be), then send the request to the lease's engine,
        failing over once; returns once the engine's status is in. Raises `GatewayError`."""
        desk = self._desk
        self.identify(tenant)
        self._inbound = inbound
        self.model, self.streaming = inbound.model, inbound.stream
        admitted = await desk.service.admit(inbound, tenant, since_s=desk.clock() - self.arrived)
        self._waited = desk.clock() - self.arrived
        desk.metrics.admission_wait.labels(self.model).observe(self._waited)
        desk.metrics.admitted(tenant.name)  # and in flight until `_account`
        if inbound.service_class is not None:
            desk.metrics.slo(inbound.service_class.name, "admitted")
        self._in_flight = True
        self.lease = admitted.lease
        admitted, response = await self._send_with_failover(admitted, body)
        refusals = 0
        while response.status_code == 503:  # the engine's front door: full now
            refusals += 1
            admitted = await self._again_after_refusal(admitted, response, refusals)
            admitted, response = await self._send_with_failover(admitted, body)
        self._admitted, self._response = admitted, response
        self._meter = UsageMeter(streaming=self.streaming, prompt_tokens=admitted.prompt_tokens)
        status = response.status_code
        if status >= 400:
            self._nothing_generated = True  # the engine refused or failed it
        if status == 404 and self.path not in PATHS.values():
            raise await self._not_served(admitted.engine.name, response)
        if status >= 500:
            text = (await response.read()).decode(errors="replace")[:500]
            raise UpstreamUnavailable(f"engine {admitted.engine.name!r} answered {status}: {text}")
        if status == 200:
            # The monitor reads these: an engine whose answers keep coming, and that starts
            # new ones, is not hung, however slow its /health (see engines/monitor.py).
            desk.pool.answer_started(admitted.engine.name)
        headers = [(k, v) for k, v in response.raw_headers if k.lower() in PASS_BACK]
        rates = admitted.lease.rates  # as the admission left them: no second trip
        if rates is None:
            rates = await self.rate_limits()
        return Answer(
            status,
            headers,
            admitted.engine.name,
            rates,
            prompt_tokens=admitted.prompt_tokens,
            blocks=admitted.lease.blocks,
            credit=admitted.lease.credit,
        )

    async def _not_served(self, engine: str, response: UpstreamAnswer) -> GatewayError:
        """An engine's 404 on an endpoint other than the completions, as the gateway's own
        OpenAI-shaped 404 (vLLM answers FastAPI's `{"detail": "Not Found"}` for an endpoint
        its model's runner does not serve; its own 404s, e.g. an unknown stored response,
        keep their message)."""
        text = (await response.read()).decode(errors="replace")[:500]
        try:
            error = json.loads(text).get("error")
        except (ValueError, AttributeError):
            error = None
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            found = EndpointNotServed(error["message"], code="not_found")
            found.param = error.get("param") if isinstance(error.get("param"), str) else None
            return found
        log.info("request %s: engine %s does not serve %s", self.request_id, engine, self.path)
        return EndpointNotServed(
            f"The engines serving `{self.model}` do not serve {self.path} (vLLM serves "
            "embeddings, pooling, score and rerank for pooling models only)."
        )

    async def relay(self) -> AsyncIterator[bytes]:
        """The engine's answer, chunk by chunk as it arrives, metered on the way; a
        predicted reservation's stream extends its lease as it outgrows it."""
        response, meter, admitted = self._response, self._meter, self._admitted
        assert response is not None and meter is not None and admitted is not None
        desk, engine = self._desk, admitted.engine.name
        ok = response.status_code == 200
        self.outcome = str(response.status_code)
        follow = self.streaming and desk.service.reservation != "worst_case"
        first = True
        timed = ok and self._sent is not None
        async for chunk in response.chunks():
            if timed and self._first_token is None:
                self._first_token_in()
            if ok:
                desk.pool.answer_progressed(engine)
            meter.feed(chunk)
            if self.kind == "responses" and ok:
                self._keep_facts(chunk)
            if follow:
                await self._top_up(meter.streamed_tokens)
            yield chunk
            if first and ok:
                self._first_byte = desk.clock() - self.arrived
                desk.metrics.first_byte.labels(self.model).observe(self._first_byte)
                first = False
        self._completed = ok
        if ok:
            desk.metrics.duration.labels(self.model).observe(desk.clock() - self.arrived)
            self._remember_response(engine)
        if timed:
            self._finished(meter.completion_tokens() or 0)

    def _first_token_in(self) -> None:
        """The answer's first chunk arrived: its first token (streamed), or all of it."""
        assert self._sent is not None and self._desk.latency is not None
        self._first_token = self._desk.clock()
        self._desk.latency.first_token(self._sent)

    def _finished(self, output_tokens: int) -> None:
        """A timed answer reached its end, whole: the latency book learns from it, and its
        service class's targets are judged (`met` or `missed`)."""
        sent, self._sent = self._sent, None
        book, first = self._desk.latency, self._first_token
        assert sent is not None and book is not None
        if first is None:  # an empty answer: no token to time
            book.dropped(sent)
            return
        book.finished(sent, output_tokens)
        service_class = self.service_class
        if service_class is None or not service_class.has_targets:
            return
        end = self._desk.clock()
        met = service_class.ttft_s is None or first - self.arrived <= service_class.ttft_s
        per_seq = output_tokens // sent.seqs
        if met and service_class.tpot_s is not None and per_seq > 1:
            met = (end - first) / (per_seq - 1) <= service_class.tpot_s
        self._desk.metrics.slo(service_class.name, "met" if met else "missed")

    def _follow(self, book: LatencyBook, admitted: Admitted) -> None:
        """Tell the latency book the request goes to `admitted`'s engine now (a completion
        only: its first event comes with its first token). Its prefill: the first prompt
        less the blocks the engine is expected to cache, the other prompts whole; each
        further sequence of `n` again, or only its last block where the engine caches
        prefixes (vLLM caches a prompt's blocks as it schedules them)."""
        self._unfollow()
        shape, spec = admitted.shape, admitted.engine
        if self.kind not in PATHS or not shape.prompt_tokens:
            return
        prefill = request_prefill(
            shape.prompt_tokens, shape.n, admitted.cached, spec.block_size, spec.prefix_caching
        )
        service_class = self.service_class
        budget = output_budget(
            max(shape.prompt_tokens),
            shape.max_output_tokens,
            spec.max_model_len,
            shape.default_output_tokens,
            clamp=True,
        )
        self._sent = book.sent(
            spec.name,
            prefill,
            service_class.tpot_s if service_class is not None else None,
            streamed=self.streaming,
            seqs=shape.n * len(shape.prompt_tokens),
            max_tokens=budget,
        )

    def _unfollow(self) -> None:
        """The engine no longer has the request (it failed, was refused, or ended)."""
        sent, self._sent = self._sent, None
        if sent is not None and self._desk.latency is not None:
            self._desk.latency.dropped(sent)

    def _keep_facts(self, chunk: bytes) -> None:
        if len(self._head) < FACTS_BYTES:
            self._head += chunk[: FACTS_BYTES - len(self._head)]
        self._tail = (self._tail + chunk)[-FACTS_BYTES:]

    def _remember_response(self, engine: str) -> None:
        """A Responses answer that reached its end: its id is stored on `engine`."""
        if self.kind != "responses":
            return
        facts = response_facts(bytes(self._head), self._tail)
        if facts is not None:
            self._desk.service.responses.remember(facts[0], engine, facts[1])

    def fail(self, error: GatewayError) -> None:
        """Count the request under `error`'s code."""
        self.outcome = error.code or str(error.status)
        if error.status in REFUSED_STATUSES and self._response is None:
            self._refused = error.code or str(error.status)
        if isinstance(error, ModelNotFound):
            self.model = UNKNOWN_MODEL

    async def rate_limits(self) -> RateLimitValues | None:
        """The tenant's rate limits now (for a refusal's headers); None when it has none or
        the store cannot say (advisory: not worth failing the answer for)."""
        if self.tenant.rpm is None and self.tenant.tpm is None:
            return None
        return await self._desk.service.rate_limits(self.tenant)

    async def settle(self) -> None:
        """Close the upstream answer (aborting it inside vLLM unless it was read to its end),
        then count, learn and release. Call once, in `finally`, whatever happened."""
        desk = self._desk
        if self._sent is not None:
            self._unfollow()
        if self._response is not None:
            await self._response.aclose()
        desk.metrics.requests.labels(self.model, self.outcome).inc()
        self._account()
        if self.lease is None:
            return
        meter = self._meter
        used = tokens_used(
            nothing_generated=self._nothing_generated,
            metered=meter.total_tokens() if meter is not None else None,
        )
        if self._completed and meter is not None and self._admitted is not None:
            generated = meter.completion_tokens()
            if generated is not None:
                desk.service.observe_output(
                    self.model, self._admitted.shape, generated, self.tenant.name
                )
        lease, self.lease = self.lease, None
        # Shielded: a second cancellation must not lose the release.
        await asyncio.shield(desk.service.release(lease, used))

    def _account(self) -> None:
        """The tenant's usage (the request, the tokens an engine answered with — nothing when
        it generated nothing — and the gateway's refusal, if it refused) and the access line."""
        metrics = self._desk.metrics
        if self._in_flight:
            metrics.tenant_in_flight.labels(self.tenant.name).dec()
            self._in_flight = False
        prompt = completion = 0
        meter, admitted = self._meter, self._admitted
        if meter is not None and admitted is not None and not self._nothing_generated:
            prompt = admitted.prompt_tokens
            completion = meter.completion_tokens() or 0
        if self._identified:
            metrics.tenant_ended(
                self.tenant.name,
                prompt_tokens=prompt,
                completion_tokens=completion,
                refused=self._refused,
            )
        if self._refused == SLO_UNATTAINABLE and self.service_class is not None:
            metrics.slo(self.service_class.name, "refused")
        if access_log.isEnabledFor(logging.INFO):
            self._log_access(prompt, completion)

    def _log_access(self, prompt_tokens: int, completion_tokens: int) -> None:
        def ms(seconds: float | None) -> float | None:
            return None if seconds is None else round(seconds * 1000, 1)

        admitted = self._admitted
        fields = {
            "request_id": self.request_id,
            "path": self.path,
            "tenant": self.tenant.name if self._identified else None,
            "model": self.model or None,
            "engine": admitted.engine.name if admitted is not None else None,
            "blocks": self.lease.blocks if self.lease is not None else None,
            "prefix_credit": self.lease.credit if self.lease is not None else None,
            "outcome": self.outcome,
            "stream": self.streaming,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "wait_ms": ms(self._waited),
            "first_byte_ms": ms(self._first_byte),
            "duration_ms": ms(self._desk.clock() - self.arrived),
        }
        access_log.info(
            "request %s %s %s tenant=%s model=%s engine=%s blocks=%s %s ms",
            self.request_id,
            self.path,
            self.outcome,
            fields["tenant"],
            fields["model"],
            fields["engine"],
            fields["blocks"],
            fields["duration_ms"],
            extra={"access": fields},
        )

    async def _send_with_failover(
        self, admitted: Admitted, body: bytes
    ) -> tuple[Admitted, UpstreamAnswer]:
        desk = self._desk
        try:
            return admitted, await self._send(admitted, body)
        except UpstreamUnavailable as e:
            if self._sent is not None:
                self._unfollow()
            desk.ejector.eject(admitted.engine.name, e.message)
            lease, self.lease = self.lease, None
            assert lease is not None and self._inbound is not None
            # The engine never saw it: its tokens come back before they are charged again.
            # Shielded: a client leaving now must not lose the release.
            await asyncio.shield(desk.service.release(lease, 0))
            admitted = await desk.service.admit(
                self._inbound,
                self.tenant,
                exclude=frozenset({admitted.engine.name}),
                counted=admitted.counted,
                since_s=desk.clock() - self.arrived,
            )
            self.lease = admitted.lease
            try:
                return admitted, await self._send(admitted, body)
            except UpstreamUnavailable:
                self._nothing_generated = True  # never reached the second engine either
                raise

    async def _again_after_refusal(
        self, admitted: Admitted, response: UpstreamAnswer, refusals: int
    ) -> Admitted:
        """Give back the lease of a request the engine refused at its front door, pass the
        engine over for a moment, and admit the request again (elsewhere, or after waiting)."""
        desk, name = self._desk, admitted.engine.name
        text = (await response.read()).decode(errors="replace")[:300]
        await response.aclose()
        log.info("request %s: engine %s is full (503: %s)", self.request_id, name, text)
        desk.metrics.engine_refusals.labels(name).inc()
        if self._sent is not None:
            self._unfollow()
        lease, self.lease = self.lease, None
        assert lease is not None and self._inbound is not None
        await asyncio.shield(desk.service.release(lease, 0))  # nothing was generated
        desk.pool.refused(name, ENGINE_FULL_HOLD_S)  # after its own release, which would clear it
        # A burst sent at once is refused, retried at once and refused again: which request
        # wins the door is luck, so a count alone would hand one unlucky client a 429 while
        # the rest were served. The request waits refusals out as long as it would wait in the
        # line, and a client hears of them only after that.
        patience = desk.service.scheduler.max_wait_s
        waited = desk.clock() - self.arrived
        if refusals >= MAX_ENGINE_REFUSALS or (
            refusals >= MIN_ENGINE_REFUSALS and waited >= patience
        ):
            self._nothing_generated = True
            raise RateLimited(
                f"The engines serving `{self.model}` refused this request {refusals} times in "
                f"{waited:.1f} s: their own queues are full.",
                code="engine_full",
                retry=RetryAdvice(ENGINE_FULL_HOLD_S * MIN_ENGINE_REFUSALS),
            )
        again = await desk.service.admit(
            self._inbound,
            self.tenant,
            counted=admitted.counted,
            since_s=desk.clock() - self.arrived,
        )
        self.lease = again.lease
        return again

    async def _send(self, admitted: Admitted, body: bytes) -> UpstreamAnswer:
        engine = admitted.engine
        if self._desk.latency is not None:
            self._follow(self._desk.latency, admitted)
        # vLLM bases its own request id on x-request-id: recent versions add a suffix, older
        # ones refuse an id already in flight (two clients, or one retrying, may send the same
        # id). The engine gets one no other request has: ours plus a suffix per attempt.
        engine_id = f"{self.request_id}-{self._desk.suffix()}"
        log.debug("request %s: sent to engine %s as %s", self.request_id, engine.name, engine_id)
        headers = {
            "content-type": "application/json",
            "accept-encoding": "identity",
            "x-request-id": engine_id,
        }
        return await self._desk.upstream.open(
            engine.url, self.path, body, headers, streaming=self.streaming
        )

    async def _top_up(self, generated: int) -> None:
        """Extend the lease of a stream that outgrew it, so admission counts its blocks now."""
        assert self._admitted is not None and self.lease is not None
        service = self._desk.service
        more = service.top_up(self._admitted, self.lease, generated)
        if more:
            before = self.lease.blocks
            self.lease = await service.extend(self.lease, more)
            if self.lease.blocks > before:  # not when the store could not extend it
                added = self.lease.blocks - before
                self._desk.metrics.extended_blocks.labels(self.model).inc(added)
