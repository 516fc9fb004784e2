"""What the gateway believes, as one JSON-ready snapshot: `/admin/status` renders it, and the
dashboard (`GET /dashboard`) polls it.

Engines (with where each of their figures came from, what they last reported, and what the
gateway holds on them), the waiting line, the traffic counters, every configured tenant's
usage, limits and service class, the service classes with their targets and counts, and each
model's output-length estimates. Read from the pool and the state
store; a lost Redis raises `StateUnavailable` (503 under `fail_closed`). The schema is
`docs/status.schema.json` (`schema_version` changes only when a field changes meaning or
goes away; new fields may appear).

Counters are cumulative (as on `/metrics`): a reader takes rates from two snapshots.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.core.types import EngineLoad, ServiceClass, TenantPolicy
from gateway.engines.pool import EnginePool, EngineState
from gateway.state.base import StateStore
from gateway.state.errors import StateUnavailable

SCHEMA_VERSION = 1

Totals = Mapping[str, Sequence[tuple[Mapping[str, str], float]]]
"""Counters and gauges by name, as `GatewayMetrics.totals()` reads them."""

_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class ModelEstimate:
    """What a model's reservations are sized by now (None: not learnt yet, or not used)."""

    predicted_output_tokens: int | None = None
    reserved_quantile: float | None = None
    reserved_margin: float | None = None


@dataclass(frozen=True, slots=True)
class Extras:
    """What the snapshot reads beside the pool and the store, gathered by the HTTP layer."""

    tenants: Sequence[TenantPolicy] = ()
    totals: Totals = field(default_factory=dict)
    models: Mapping[str, ModelEstimate] = field(default_factory=dict)
    oldest_wait_s: float | None = None
    """This process's longest-waiting queued request."""
    worker: tuple[int, int] | None = None
    """(index, count) under `serve --workers N`."""
    service_classes: Sequence[ServiceClass] = ()
    """The configured classes (`slo.classes`)."""
    default_class: str | None = None
    class_header: str | None = None
    stored_responses: tuple[int, int] = (0, 0)
    """This process's Responses API id log (`stored_responses.ResponseLog`): entries, bound."""


async def snapshot(
    store: StateStore,
    pool: EnginePool,
    kv_ceiling: float,
    extras: Extras | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
    prefix_index: Callable[[str], dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """The status document (`docs/status.schema.json`). `prefix_index`: each engine's entry
    of the prefix index (gateway/prefixes.py)."""
    extras = extras or Extras()
    loads = await store.loads()
    engines = []
    for state in pool:
        load = loads.get(state.spec.name)
        engines.append(
            {
                **_engine(state, kv_ceiling, clock()),
                "reserved_blocks": load.reserved_blocks if load else 0,
                "reserved_seqs": load.reserved_seqs if load else 0,
                "staged_seqs": pool.view(state.spec.name, EngineLoad()).staged_seqs,
                "prefix_index": None if prefix_index is None else prefix_index(state.spec.name),
            }
        )
    index, count = extras.worker if extras.worker is not None else (None, 1)
    return {
        "schema_version": SCHEMA_VERSION,
        "id": f"{os.getpid()}-{next(_ids)}",
        "generated_at": round(wall(), 3),
        "process": {
            "pid": os.getpid(),
            "worker": index,
            "workers": count,
            "stored_responses": {
                "entries": extras.stored_responses[0],
                "max": extras.stored_responses[1],
            },
        },
        "engines": engines,
        "queue": {
            "length": await store.queue_length(),
            "oldest_wait_s": None
            if extras.oldest_wait_s is None
            else round(extras.oldest_wait_s, 3),
        },
        "traffic": _traffic(extras.totals),
        "tenants": [await _tenant(store, t, extras.totals) for t in extras.tenants],
        "slo": {
            "header": extras.class_header,
            "default_class": extras.default_class,
            "classes": [_service_class(c, extras.totals) for c in extras.service_classes],
        },
        "models": [
            {
                "name": name,
                "predicted_output_tokens": estimate.predicted_output_tokens,
                "reserved_quantile": estimate.reserved_quantile,
                "reserved_margin": None
                if estimate.reserved_margin is None
                else round(estimate.reserved_margin, 3),
            }
            for name, estimate in sorted(extras.models.items())
        ],
    }


def _sum(totals: Totals, name: str, **match: str) -> float:
    return sum(
        value
        for labels, value in totals.get(name, ())
        if all(labels.get(k) == v for k, v in match.items())
    )


def _by(totals: Totals, name: str, key: str, **match: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for labels, value in totals.get(name, ()):
        if all(labels.get(k) == v for k, v in match.items()) and value:
            out[labels[key]] = out.get(labels[key], 0) + int(value)
    return dict(sorted(out.items()))


def _traffic(totals: Totals) -> dict[str, Any]:
    return {
        "requests": _by(totals, "kv_gateway_requests", "outcome"),
        "admitted": int(_sum(totals, "kv_gateway_admission_wait_seconds")),
        "queued": _by(totals, "kv_gateway_queued", "outcome"),
        "refused": _by(totals, "kv_gateway_tenant_refusals", "reason"),
        "engine_refusals": int(_sum(totals, "kv_gateway_engine_refusals")),
    }


async def _tenant(store: StateStore, tenant: TenantPolicy, totals: Totals) -> dict[str, Any]:
    name = tenant.name
    rates: dict[str, Any] | None = None
    if tenant.rpm is not None or tenant.tpm is not None:
        try:
            values = await store.rate_limits(tenant)
        except StateUnavailable:
            values = None
        if values is not None:
            rates = {
                "remaining_requests": values.remaining_requests,
                "remaining_tokens": values.remaining_tokens,
            }
    return {
        "name": name,
        "limits": {
            "max_concurrency": tenant.max_concurrency,
            "rpm": tenant.rpm,
            "tpm": tenant.tpm,
            "kv_share": tenant.kv_share,
            "priority": tenant.priority,
            "weight": tenant.weight,
            "max_queued": tenant.max_queued,
        },
        "in_flight": int(_sum(totals, "kv_gateway_tenant_in_flight", tenant=name)),
        "requests": int(_sum(totals, "kv_gateway_tenant_requests", tenant=name)),
        "admitted": int(_sum(totals, "kv_gateway_tenant_admitted", tenant=name)),
        "prompt_tokens": int(_sum(totals, "kv_gateway_tenant_prompt_tokens", tenant=name)),
        "completion_tokens": int(_sum(totals, "kv_gateway_tenant_completion_tokens", tenant=name)),
        "refusals": _by(totals, "kv_gateway_tenant_refusals", "reason", tenant=name),
        "rate_limits": rates,
        "service_class": None if tenant.service_class is None else tenant.service_class.name,
        "service_classes": [c.name for c in tenant.service_classes],
    }


def _service_class(service_class: ServiceClass, totals: Totals) -> dict[str, Any]:
    of_class = {"class": service_class.name}  # `class` is a keyword: no `class=` argument
    return {
        "name": service_class.name,
        "ttft_s": service_class.ttft_s,
        "tpot_s": service_class.tpot_s,
        "requests": {
            outcome: int(_sum(totals, "kv_gateway_slo_requests", outcome=outcome, **of_class))
            for outcome in ("admitted", "refused", "met", "missed")
        },
    }


def _engine(state: EngineState, kv_ceiling: float, now: float) -> dict[str, Any]:
    spec = state.spec
    return {
        "name": spec.name,
        "url": spec.url,
        "models": sorted(spec.models),
        "healthy": state.healthy,
        "last_error": state.last_error,
        "reported": {
            "used_blocks": state.used_blocks,
            "running": state.running,
            "waiting": state.waiting,
            "kv_cache_usage": state.kv_cache_usage,
            "num_preemptions": state.preemptions,
            "age_s": None if state.last_scrape is None else round(now - state.last_scrape, 3),
            "missing": list(state.missing),
        },
        "foreign": {"seqs": state.foreign.seqs, "blocks": state.foreign.blocks},
        "num_gpu_blocks": spec.num_gpu_blocks,
        "block_size": spec.block_size,
        "max_num_seqs": spec.max_num_seqs,
        "max_model_len": spec.max_model_len,
        "capacity_blocks": spec.capacity_blocks(kv_ceiling),
        "sources": state.sources,
        "prefix_caching": spec.prefix_caching,
    }
