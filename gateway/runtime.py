"""Everything one gateway process runs with, built once at start-up and closed at shutdown."""

from __future__ import annotations

import logging
import os
import random
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from gateway.auth import AdminGate, Authenticator
from gateway.config import ConfigError, GatewayConfig, MediaConfig
from gateway.core.latency import LatencyModels
from gateway.core.prefix import PrefixIndex
from gateway.core.retry import ReleaseRate
from gateway.core.routing import Router
from gateway.core.types import DEFAULT_TENANT, EngineLoad
from gateway.engines.monitor import EngineMonitor
from gateway.engines.pool import EnginePool
from gateway.engines.setup import resolve_engines
from gateway.engines.sharing import SharedMonitor, SharedPool
from gateway.exchange import Exchanges
from gateway.heap import HeapTrimmer
from gateway.latency import LatencyBook
from gateway.media import FAMILIES, MediaCounter, MediaPolicy
from gateway.media.families import MODALITIES
from gateway.media.sources import FetchPolicy
from gateway.metrics import GatewayMetrics
from gateway.prefixes import PrefixCache
from gateway.proxy import Upstream
from gateway.scheduler import Scheduler
from gateway.service import ChatFlags, ModelRules, Service
from gateway.state.base import StateStore
from gateway.state.errors import StateUnavailable
from gateway.state.fallback import FailOpenLocal
from gateway.state.memory import InMemoryStore
from gateway.state.redis import RedisStore
from gateway.tokens import make_counter
from gateway.tokens.chat import Modality
from gateway.tokens.protocol import TokenCounter

if TYPE_CHECKING:
    from gateway.engines.kv_events import KvEventSubscriber

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """The composition root: every long-lived piece, built once and handed to who needs it."""

    cfg: GatewayConfig
    upstream: Upstream
    pool: EnginePool
    store: StateStore
    scheduler: Scheduler
    service: Service
    auth: Authenticator
    admin: AdminGate
    monitor: EngineMonitor
    metrics: GatewayMetrics
    exchanges: Exchanges
    kv_events: KvEventSubscriber | None = None
    heap: HeapTrimmer | None = None

    def reload_keys(self, new: GatewayConfig) -> list[str]:
        """Take `new`'s tenants (keys, limits, service classes), admin keys and service
        classes (`slo.classes`, `default_class`, `header`) for the requests that arrive from
        now on; requests already admitted keep what they were admitted under. Returns the
        other top-level sections that differ from the running configuration (`slo` when
        its step costs do): they need a restart and are left as they are."""
        slo = self.cfg.slo.model_copy(
            update={
                "classes": new.slo.classes,
                "default_class": new.slo.default_class,
                "header": new.slo.header,
            }
        )
        self.auth.load(new.tenants, slo)
        self.admin.load(new.admin, new.tenants)
        self.metrics.know_tenants(t.name for t in new.tenants)
        self.metrics.know_classes(slo.classes)
        self.cfg = self.cfg.model_copy(
            update={"tenants": new.tenants, "admin": new.admin, "slo": slo}
        )
        running, wanted = self.cfg.model_dump(), new.model_dump()
        applied = ("tenants", "admin")
        return sorted(k for k in wanted if k not in applied and wanted[k] != running.get(k))

    async def aclose(self) -> None:
        if self.heap is not None:
            await self.heap.stop()
        await self.monitor.stop()
        if self.kv_events is not None:
            await self.kv_events.stop()
        await self.store.close()
        await self.upstream.aclose()


def make_store(cfg: GatewayConfig, router: Router) -> StateStore:
    """In-process state, or Redis when configured (several replicas share it), with the
    in-process store behind it under `on_failure: fail_open_local`."""

    def in_process() -> InMemoryStore:
        return InMemoryStore(
            router,
            random.Random(cfg.routing.seed),
            burst_blocks=cfg.queue.fair_burst_blocks,
            headroom=cfg.admission.share_headroom,
            active_window_s=cfg.admission.active_window_s,
        )

    if cfg.redis is None:
        return in_process()
    replica = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    log.info("shared state: Redis %s (replica %s)", _redacted(cfg.redis.url), replica)
    shared = RedisStore(
        cfg.redis.url,
        router.scorer_names,
        replica_id=replica,
        cached_block_weight=router.cached_block_weight,
        lease_ttl_s=cfg.redis.lease_ttl_s,
        key_prefix=cfg.redis.key_prefix,
        timeout_s=cfg.redis.timeout_s,
        max_connections=cfg.redis.max_connections,
        seed=cfg.routing.seed,
        burst_blocks=cfg.queue.fair_burst_blocks,
        headroom=cfg.admission.share_headroom,
        active_window_s=cfg.admission.active_window_s,
    )
    if cfg.redis.on_failure == "fail_open_local":
        return FailOpenLocal(shared, in_process(), cfg.redis.local_share)
    return shared


def _media_policy(media: MediaConfig | None) -> MediaPolicy | None:
    """`models[].media` as the media counter's policy (None: not configured)."""
    if media is None:
        return None
    family = None
    if media.family is not None:
        family = FAMILIES[media.family].with_settings(
            min_pixels=media.min_pixels,
            max_pixels=media.max_pixels,
            image_tokens=media.image_tokens,
        )
    worst: dict[Modality, int] = {}
    for modality in MODALITIES:
        tokens = getattr(media.worst_case, modality)
        if tokens is not None:
            worst[modality] = tokens
    return MediaPolicy(
        family=family,
        worst_case=worst,
        max_image_bytes=media.max_image_bytes,
        max_image_pixels=media.max_image_pixels,
        fetch=FetchPolicy(
            enabled=media.fetch.enabled,
            max_bytes=media.fetch.max_bytes,
            timeout_s=media.fetch.timeout_s,
        ),
    )


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        parts = parts._replace(netloc=parts.netloc.replace(parts.password, "***"))
    return urlunsplit(parts)


async def build_runtime(cfg: GatewayConfig, shared_pool: SharedPool | None = None) -> Runtime:
    """Discover the engines and build everything the process runs with; what was opened is
    closed again if a step fails (a bad tokenizer path is a `ConfigError`). `shared_pool`:
    this process is one of `serve --workers N`, and one engine monitor serves them all."""
    upstream = Upstream(cfg.upstream)
    store: StateStore | None = None
    try:
        specs, sources = await resolve_engines(cfg, upstream.client)
        pool = EnginePool(specs, sources, staged_seqs=cfg.admission.staged_seqs)
        router = Router(cfg.routing.scorers, cached_block_weight=cfg.routing.cached_block_weight)
        store = make_store(cfg, router)
        return _assemble(cfg, upstream, pool, store, shared_pool)
    except BaseException:
        if store is not None:
            await store.close()
        await upstream.aclose()
        raise


def _assemble(
    cfg: GatewayConfig,
    upstream: Upstream,
    pool: EnginePool,
    store: StateStore,
    shared_pool: SharedPool | None = None,
) -> Runtime:
    metrics = GatewayMetrics()
    metrics.know_tenants([t.name for t in cfg.tenants] or [DEFAULT_TENANT.name])
    metrics.know_classes(cfg.slo.classes)
    scheduler = Scheduler(
        store=store,
        pool=pool,
        max_length=cfg.queue.max_length,
        kv_ceiling=cfg.admission.kv_ceiling,
        max_wait_s=cfg.queue.max_wait_s,
        retry_fallback_s=cfg.admission.retry_fallback_s,
        rate=ReleaseRate(cfg.admission.rate_window_s),
        tally=metrics,
    )

    def setup(model: str) -> tuple[TokenCounter, ModelRules]:
        """The token counter and rules of `model`: at start-up for the models the engines
        serve, later for a model an engine is first seen serving when it is rediscovered."""
        return _model_setup(cfg, upstream, pool, model)

    counters: dict[str, TokenCounter] = {}
    rules: dict[str, ModelRules] = {}
    for model in pool.models():
        counters[model], rules[model] = setup(model)
    prefixes = PrefixCache(
        pool,
        credit=cfg.prefix_cache.credit,
        index=PrefixIndex(cfg.prefix_cache.index_entries)
        if cfg.prefix_cache.index_entries
        else None,
    )
    kv_events = _kv_events(cfg, pool, prefixes)
    latency = _latency_book(cfg, pool)
    unserved = [m.name for m in cfg.models if m.name not in counters]
    if unserved:
        log.warning("configured models served by no engine: %s", unserved)
    service = Service(
        pool=pool,
        scheduler=scheduler,
        counters=counters,
        setup=setup,
        kv_ceiling=cfg.admission.kv_ceiling,
        reservation=cfg.admission.reservation,
        prediction=cfg.admission.prediction.policy(),
        adaptive=cfg.admission.adaptive.policy(),
        clamp=cfg.admission.over_length == "clamp",
        models=rules,
        prefixes=prefixes,
        latency=latency,
        engine_flags={
            e.display_name: ChatFlags(
                exclude_tools_when_tool_choice_none=e.exclude_tools_when_tool_choice_none,
                trust_request_chat_template=e.trust_request_chat_template,
            )
            for e in cfg.engines
        },
    )

    async def own_loads() -> Mapping[str, EngineLoad] | None:
        try:
            return await store.loads()
        except StateUnavailable:
            return None

    monitor: EngineMonitor
    pages = None if latency is None else latency.scraped
    if shared_pool is None:
        monitor = EngineMonitor(pool, upstream.client, cfg.health, own_loads=own_loads, pages=pages)
    else:
        monitor = SharedMonitor(
            pool, upstream.client, cfg.health, own_loads=own_loads, pages=pages, shared=shared_pool
        )
    exchanges = Exchanges(
        service=service,
        upstream=upstream,
        ejector=monitor,
        pool=pool,
        metrics=metrics,
        latency=latency,
    )
    admin = AdminGate(cfg.admin, cfg.tenants)
    if admin.state == "closed":
        log.warning(
            "admin surface (/admin/*, /metrics) closed: tenants are configured and "
            "admin.api_keys is not; configure admin keys to read it"
        )
    else:
        log.info("admin surface (/admin/*, /metrics): %s", admin.state)
    monitor.start()
    if kv_events is not None:
        kv_events.start()
    heap = HeapTrimmer()
    heap.start()
    return Runtime(
        cfg=cfg,
        upstream=upstream,
        pool=pool,
        store=store,
        scheduler=scheduler,
        service=service,
        auth=Authenticator(cfg.tenants, cfg.slo),
        admin=admin,
        monitor=monitor,
        metrics=metrics,
        exchanges=exchanges,
        kv_events=kv_events,
        heap=heap,
    )


def _latency_book(cfg: GatewayConfig, pool: EnginePool) -> LatencyBook | None:
    """Each engine's latency model and what feeds it (gateway/latency.py), when some
    service class has a target; None otherwise, and nothing is timed: a gateway without
    targets does no more per request than before. (Built at start-up: a class with targets
    added by a reload of a configuration that had none is timed after a restart.) The set
    of engines is the pool's, fixed at start-up; a restarted engine is forgotten by the
    book when its scrape shows a new process start time."""
    classes = cfg.slo.classes.values()
    if all(c.ttft_s is None and c.tpot_s is None for c in classes):
        return None
    names = [e.spec.name for e in pool]
    models = LatencyModels(
        cfg.slo.step_costs.costs(),
        per_engine={name: cfg.step_costs_for(name) for name in names},
    )
    book = LatencyBook(models, pool, calibrate=cfg.slo.calibrate, line=cfg.queue.max_length)
    book.retain(names)
    return book


def _kv_events(
    cfg: GatewayConfig, pool: EnginePool, prefixes: PrefixCache
) -> KvEventSubscriber | None:
    """The subscriber to the engines configured with `kv_events`, their feeds set up in
    `prefixes` (None: no engine is)."""
    endpoints = {e.display_name: e.kv_events for e in cfg.engines if e.kv_events}
    if not endpoints:
        return None
    try:
        from gateway.engines.kv_events import KvEventSubscriber
    except ImportError as e:
        raise ConfigError(
            f"engines[].kv_events needs pyzmq and msgspec ({e}): "
            "pip install 'kv-gateway[kv-events]'"
        ) from None
    for name in endpoints:
        state = pool.get(name)
        models = sorted(state.spec.models) if state is not None else []
        if len(models) != 1:
            raise ConfigError(
                f"engines[{name}].kv_events: the engine serves {models}; its events do not "
                "name the model, so the exact mode needs an engine serving one model"
            )
        if state is not None and state.spec.dp_size > 1:
            log.warning(
                "engine %s: %d data-parallel ranks publish their KV events on %d ports "
                "(the configured one + rank); only %s is followed",
                name,
                state.spec.dp_size,
                state.spec.dp_size,
                endpoints[name],
            )
        prefixes.follow(name, models[0])
    return KvEventSubscriber(endpoints, prefixes.events, prefixes.lost)


def _model_setup(
    cfg: GatewayConfig, upstream: Upstream, pool: EnginePool, model: str
) -> tuple[TokenCounter, ModelRules]:
    """`model`'s token counter (as `models:` configures it, else the engine's) and rules;
    raises `ConfigError` when its tokenizer cannot be loaded."""
    settings = cfg.model_settings(model)
    spec = settings.tokenizer

    def urls(model: str = model) -> list[str]:
        return [e.spec.url for e in pool.serving(model) if e.healthy]

    policy = _media_policy(settings.media)
    try:
        counter = make_counter(
            spec,
            model=model,
            tokenize_urls=urls,
            client=upstream.tokenize_session() if spec == "engine" else None,
            timeout=upstream.tokenize_timeout,
            template_defaults=settings.default_chat_template_kwargs,
            media=policy.family.template if policy and policy.family else None,
            engine_expands_media=settings.media is None or settings.media.engine_counts_media,
        )
    except ValueError as e:  # e.g. an hf: directory that is not there
        raise ConfigError(f"models: {e}") from None
    engine_counts = spec == "engine" and (
        settings.media is None or settings.media.engine_counts_media
    )
    media = None
    if policy is not None or spec == "engine":
        media = MediaCounter(
            model,
            policy or MediaPolicy(),
            counts=not engine_counts,
            session=upstream.media_session,
        )
    log.info("model %s: token counter %s", model, spec)
    return counter, ModelRules(uses_kv_cache=settings.uses_kv_cache, media=media)
