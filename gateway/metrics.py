"""The gateway's own `/metrics` (Prometheus text), in a registry of its own.

Counters are updated on the request path; gauges of state (reservations, queue, health) are
read from the store and the pool when scraped.

Under `serve --workers N` (`PROMETHEUS_MULTIPROC_DIR` set by the supervisor) every worker
writes its values to files in that directory (prometheus_client's multiprocess mode) and a
scrape, whichever worker answers it, renders all of them: counters and histograms summed
over the workers (the dead ones' included: counts do not go back), the gauges a scrape sets
(state, engines, estimates) as the scraping worker set them (`mostrecent`), and the open
client connections and tenants' requests in flight summed over the live workers
(`livesum`). `totals()` reads the same values back for the dashboard's JSON (`/admin/status`).

Per-tenant series are labelled only with tenant names from the configuration (and `default`
when none is configured): a client's key selects one of them, nothing a client sends becomes
a label. Refusal reasons are the gateway's own error codes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from gateway.core.reservation import AdaptiveReservation, OutputLengths
from gateway.core.types import EngineLoad
from gateway.engines.pool import EnginePool
from gateway.state.base import StateStore
from gateway.state.errors import StateUnavailable

MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"
"""Set (by `serve --workers N`) to the directory where the workers' values are kept."""

REFUSED_STATUSES = frozenset({429, 503})
"""The gateway's refusals (it will not take the request now), counted per tenant by reason."""

LINE_OUTCOMES = ("admitted", "refused", "abandoned", "failed")
"""How a stay in the waiting line ends (`kv_gateway_queued_total`'s `outcome`): a reservation
taken; a refusal (429, 503: `queue_timeout`, a tenant limit, no healthy engine, the store
unreachable); the client gone; any other error (500)."""

SLO_OUTCOMES = ("admitted", "refused", "met", "missed")
"""What became of a request with a service class (`kv_gateway_slo_requests_total`'s
`outcome`; see `GatewayMetrics.slo`)."""

SLO_UNATTAINABLE = "slo_unattainable"
"""The code of the 429 that refuses a request early because its class's targets cannot be
met on any engine (counted as the class's `refused`)."""

WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kv_gateway_requests",
            "Requests answered, by model and outcome (HTTP status, or the 429/4xx/5xx code).",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.admission_wait = Histogram(
            "kv_gateway_admission_wait_seconds",
            "Time from arrival to a reservation (queueing included), admitted requests only.",
            ["model"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.queued = Counter(
            "kv_gateway_queued",
            "Requests that waited in the line, counted as they left it, by outcome: admitted "
            "(a reservation after waiting), refused (429/503 after waiting: queue_timeout, a "
            "tenant limit, no healthy engine, the store unreachable), abandoned (the client "
            "left while waiting), failed (any other error). A request the line refused at "
            "once (queue_full) never waited; one re-admitted after an engine's refusal that "
            "waits again counts again.",
            ["outcome"],
            registry=self.registry,
        )
        # Bound once: leaving the line costs a lookup by a constant string, no label tuple.
        self._left_line = {outcome: self.queued.labels(outcome) for outcome in LINE_OUTCOMES}
        self.first_byte = Histogram(
            "kv_gateway_first_byte_seconds",
            "Time from arrival to the first byte of the engine's answer sent to the client "
            "(queueing, admission and the engine's time to first token; 200 answers).",
            ["model"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "kv_gateway_request_duration_seconds",
            "Time from arrival to the end of the answer, requests answered 200 in full.",
            ["model"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.queue_length = Gauge(
            "kv_gateway_queue_length",
            "Requests waiting for capacity.",
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.reserved_blocks = Gauge(
            "kv_gateway_reserved_blocks",
            "KV blocks reserved.",
            ["engine"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.reserved_seqs = Gauge(
            "kv_gateway_reserved_seqs",
            "Sequences reserved.",
            ["engine"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.capacity_blocks = Gauge(
            "kv_gateway_capacity_blocks",
            "KV blocks reservations may hold (kv_ceiling × usable blocks).",
            ["engine"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.engine_healthy = Gauge(
            "kv_gateway_engine_healthy",
            "1 while the engine is routed to.",
            ["engine"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.engine_used_blocks = Gauge(
            "kv_gateway_engine_reported_used_blocks",
            "KV blocks the engine reported in use at its last scrape.",
            ["engine"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.engine_foreign_blocks = Gauge(
            "kv_gateway_engine_foreign_blocks",
            "KV blocks in use on the engine that are not the gateway's own (other clients, "
            "other gateways), estimated at its last scrape.",
            ["engine"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.engine_foreign_seqs = Gauge(
            "kv_gateway_engine_foreign_seqs",
            "Sequences running or waiting on the engine that are not the gateway's own, "
            "estimated at its last scrape.",
            ["engine"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.engine_refusals = Counter(
            "kv_gateway_engine_refusals",
            "Requests an engine refused at its own front door (vLLM's --max-num-queued-reqs or "
            "--max-num-queued-tokens: 503); each was admitted again, not failed.",
            ["engine"],
            registry=self.registry,
        )
        self.state_up = Gauge(
            "kv_gateway_state_up",
            "1 while the state store answers (always, in-process); 0 while Redis cannot be "
            "reached: the reserved and queue gauges then keep their last values (fail_closed) "
            "or show this replica's local share (fail_open_local).",
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.extended_blocks = Counter(
            "kv_gateway_extended_blocks",
            "KV blocks added to the leases of streams that outgrew a predicted reservation.",
            ["model"],
            registry=self.registry,
        )
        self.predicted_output = Gauge(
            "kv_gateway_predicted_output_tokens",
            "The quantile of the model's recent output lengths (tokens per sequence), all "
            "tenants together: what a `predicted` reservation reserves at most for a tenant "
            "without enough samples of its own; absent until enough requests completed.",
            ["model"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.reserved_quantile = Gauge(
            "kv_gateway_reserved_quantile",
            "`adaptive` reservations: the quantile of recent output lengths reserved for, as "
            "the engines' preemptions steer it.",
            ["model"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.reserved_margin = Gauge(
            "kv_gateway_reserved_margin",
            "`adaptive` reservations: how many times the recent outputs' mean excess over "
            "the quantile is reserved beyond it, as the engines' preemptions steer it.",
            ["model"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )

        self.client_connections = Gauge(
            "kv_gateway_client_connections",
            "Client connections open now (clients.max_connections caps them).",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.client_cutoffs = Counter(
            "kv_gateway_client_cutoffs",
            "Client connections the listener ended: too slow to send the request headers "
            "(header_timeout) or body (body_timeout), over a connection cap "
            "(too_many_connections), or a request head over its limits "
            "(request_header_fields_too_large, uri_too_long).",
            ["reason"],
            registry=self.registry,
        )
        self.tenant_requests = Counter(
            "kv_gateway_tenant_requests",
            "Requests per tenant (authenticated), whatever their outcome.",
            ["tenant"],
            registry=self.registry,
        )
        self.tenant_prompt_tokens = Counter(
            "kv_gateway_tenant_prompt_tokens",
            "Prompt tokens of the tenant's requests an engine answered (as vLLM's "
            "usage.prompt_tokens counts them).",
            ["tenant"],
            registry=self.registry,
        )
        self.tenant_completion_tokens = Counter(
            "kv_gateway_tenant_completion_tokens",
            "Tokens generated for the tenant, as the engine's answers report them (a stream "
            "without usage: its content events).",
            ["tenant"],
            registry=self.registry,
        )
        self.tenant_admitted = Counter(
            "kv_gateway_tenant_admitted",
            "The tenant's requests admitted (a reservation taken), counted once each at their "
            "first admission: what its `rpm` limits (a re-admission after an engine's refusal "
            "or a failover is charged to the bucket again but not counted again).",
            ["tenant"],
            registry=self.registry,
        )
        self._admitted_by_tenant: dict[str, Counter] = {}
        self.tenant_refusals = Counter(
            "kv_gateway_tenant_refusals",
            "The tenant's requests the gateway refused (429, 503), by reason: the error code "
            "(tenant_rpm, tenant_tpm, tenant_concurrency, tenant_kv_share, queue_full, "
            "queue_timeout, engine_full, no_healthy_engine, state_unavailable).",
            ["tenant", "reason"],
            registry=self.registry,
        )
        self.tenant_in_flight = Gauge(
            "kv_gateway_tenant_in_flight",
            "The tenant's requests admitted and not yet ended.",
            ["tenant"],
            registry=self.registry,
            multiprocess_mode="livesum",
        )

        self.slo_requests = Counter(
            "kv_gateway_slo_requests",
            "Requests with a service class, by class and outcome: admitted (a reservation "
            "taken, once per request), refused (429 slo_unattainable: its targets could not "
            "be met), met or missed (its targets, judged when the answer ends; classes with "
            "targets only).",
            ["class", "outcome"],
            registry=self.registry,
        )
        self._slo: dict[tuple[str, str], Counter] = {}

    def know_classes(self, names: Iterable[str]) -> None:
        """Show the configured service classes' series at 0 before their first request."""
        for name in names:
            for outcome in SLO_OUTCOMES:
                self._slo[name, outcome] = self.slo_requests.labels(name, outcome)

    def slo(self, class_name: str, outcome: str) -> None:
        """One request of the service class `class_name` was `outcome` (one of
        `SLO_OUTCOMES`): `admitted` at its first reservation; `refused` when answered 429
        `slo_unattainable`; when its answer ends (200, in full), `met` if every target the
        class sets held, else `missed` — counted only for classes with targets. TTFT, from
        the request's arrival at the gateway to its first token, must be ≤ `ttft_s`; TPOT,
        `(end − first token) / (output tokens − 1)`, ≤ `tpot_s` (not judged for an answer
        of one token)."""
        child = self._slo.get((class_name, outcome))
        if child is None:  # a class not made known (`know_classes`)
            if outcome not in SLO_OUTCOMES:
                raise ValueError(f"outcome must be one of {SLO_OUTCOMES}, not {outcome!r}")
            child = self._slo[class_name, outcome] = self.slo_requests.labels(class_name, outcome)
        child.inc()

    def know_tenants(self, names: Iterable[str]) -> None:
        """Show the configured tenants' series at 0 before their first request (a `rate()`
        needs the series to exist before it grows)."""
        for name in names:
            self.tenant_requests.labels(name)
            self.tenant_admitted.labels(name)
            self.tenant_prompt_tokens.labels(name)
            self.tenant_completion_tokens.labels(name)
            self.tenant_in_flight.labels(name)

    def left_line(self, outcome: str) -> None:
        """A request that waited in the line left it, as `outcome` (one of `LINE_OUTCOMES`;
        the scheduler's `LineTally`)."""
        self._left_line[outcome].inc()

    def admitted(self, tenant: str) -> None:
        """One of `tenant`'s requests took its first reservation: counted as admitted, and
        as in flight (its caller takes it out of `tenant_in_flight` when it ends)."""
        child = self._admitted_by_tenant.get(tenant)
        if child is None:  # the tenant's first admission in this process
            child = self._admitted_by_tenant[tenant] = self.tenant_admitted.labels(tenant)
        child.inc()
        self.tenant_in_flight.labels(tenant).inc()

    def tenant_ended(
        self,
        tenant: str,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        refused: str | None,
    ) -> None:
        """One of `tenant`'s requests ended: its tokens, and the reason it was refused, if."""
        self.tenant_requests.labels(tenant).inc()
        if prompt_tokens:
            self.tenant_prompt_tokens.labels(tenant).inc(prompt_tokens)
        if completion_tokens:
            self.tenant_completion_tokens.labels(tenant).inc(completion_tokens)
        if refused is not None:
            self.tenant_refusals.labels(tenant, refused).inc()

    def totals(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """Every counter (by its name without `_total`), gauge and histogram's count as it
        stands, as (labels, value) pairs: this process's, or under `serve --workers N` every
        worker's, as a scrape renders them (counters summed)."""
        registry = self.registry
        if MULTIPROCESS_DIR in os.environ:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in registry.collect():
            suffix = {"counter": "_total", "gauge": "", "histogram": "_count"}.get(family.type)
            if suffix is None:
                continue
            wanted = family.name + suffix
            out[family.name] = [
                (dict(s.labels), s.value) for s in family.samples if s.name == wanted
            ]
        return out

    async def render(
        self,
        store: StateStore,
        pool: EnginePool,
        output_lengths: Mapping[str, OutputLengths],
        kv_ceiling: float,
        adaptive: Mapping[str, AdaptiveReservation] | None = None,
    ) -> bytes:
        """The page: counters as they stand, gauges read now from the store and the pool."""
        # Scraped most when something is wrong: an unreachable Redis leaves the gauges read
        # from it at their last values and says so, rather than failing the scrape.
        loads: Mapping[str, EngineLoad] | None
        try:
            loads = await store.loads()
            self.queue_length.set(await store.queue_length())
        except StateUnavailable:
            loads = None
        # `fail_open_local` answers from its local share instead of raising: down all the same.
        self.state_up.set(0 if loads is None or store.degraded else 1)
        for state in pool:
            name = state.spec.name
            if loads is not None:
                load = loads.get(name)
                self.reserved_blocks.labels(name).set(load.reserved_blocks if load else 0)
                self.reserved_seqs.labels(name).set(load.reserved_seqs if load else 0)
            self.capacity_blocks.labels(name).set(state.spec.capacity_blocks(kv_ceiling))
            self.engine_healthy.labels(name).set(1 if state.healthy else 0)
            self.engine_used_blocks.labels(name).set(state.used_blocks or 0)
            self.engine_foreign_blocks.labels(name).set(state.foreign.blocks)
            self.engine_foreign_seqs.labels(name).set(state.foreign.seqs)
        for model, lengths in output_lengths.items():
            predicted = lengths.predicted()
            if predicted is not None:
                self.predicted_output.labels(model).set(predicted)
        for model, steered in (adaptive or {}).items():
            self.reserved_quantile.labels(model).set(steered.quantile)
            self.reserved_margin.labels(model).set(steered.margin)
        if MULTIPROCESS_DIR in os.environ:
            every_worker = CollectorRegistry()
            MultiProcessCollector(every_worker)  # type: ignore[no-untyped-call]
            return generate_latest(every_worker)
        return generate_latest(self.registry)
