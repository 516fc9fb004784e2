"""Everything one gateway process runs with, built once at start-up and closed at shutdown."""

from __future__ import annotations

import logging
import os
import random
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from gateway.auth import AdminGate, Authenticator
from gateway.config import ConfigError, GatewayConfig
from gateway.core.retry import ReleaseRate
from gateway.core.routing import Router
from gateway.core.types import EngineLoad
from gateway.engines.monitor import EngineMonitor
from gateway.engines.pool import EnginePool
from gateway.engines.setup import resolve_engines
from gateway.exchange import Exchanges
from gateway.metrics import GatewayMetrics
from gateway.proxy import Upstream
from gateway.scheduler import Scheduler
from gateway.service import Service
from gateway.state.base import StateStore
from gateway.state.errors import StateUnavailable
from gateway.state.fallback import FailOpenLocal
from gateway.state.memory import InMemoryStore
from gateway.state.redis import RedisStore
from gateway.tokens import make_counter
from gateway.tokens.protocol import TokenCounter

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

    def reload_keys(self, new: GatewayConfig) -> list[str]:
        """Take `new`'s tenants (keys and limits) and admin keys for the requests that arrive
        from now on; requests already admitted keep what they were admitted under. Returns
        the other top-level sections that differ from the running configuration: they need
        a restart and are left as they are."""
        self.auth.load(new.tenants)
        self.admin.load(new.admin, new.tenants)
        self.cfg = self.cfg.model_copy(update={"tenants": new.tenants, "admin": new.admin})
        running, wanted = self.cfg.model_dump(), new.model_dump()
        applied = ("tenants", "admin")
        return sorted(k for k in wanted if k not in applied and wanted[k] != running.get(k))

    async def aclose(self) -> None:
        await self.monitor.stop()
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
        lease_ttl_s=cfg.redis.lease_ttl_s,
        key_prefix=cfg.redis.key_prefix,
        timeout_s=cfg.redis.timeout_s,
        seed=cfg.routing.seed,
        burst_blocks=cfg.queue.fair_burst_blocks,
        headroom=cfg.admission.share_headroom,
        active_window_s=cfg.admission.active_window_s,
    )
    if cfg.redis.on_failure == "fail_open_local":
        return FailOpenLocal(shared, in_process(), cfg.redis.local_share)
    return shared


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        parts = parts._replace(netloc=parts.netloc.replace(parts.password, "***"))
    return urlunsplit(parts)


async def build_runtime(cfg: GatewayConfig) -> Runtime:
    """Discover the engines and build everything the process runs with; what was opened is
    closed again if a step fails (a bad tokenizer path is a `ConfigError`)."""
    upstream = Upstream(cfg.upstream)
    store: StateStore | None = None
    try:
        specs, sources = await resolve_engines(cfg, upstream.client)
        pool = EnginePool(specs, sources)
        router = Router(cfg.routing.scorers)
        store = make_store(cfg, router)
        return _assemble(cfg, upstream, pool, store)
    except BaseException:
        if store is not None:
            await store.close()
        await upstream.aclose()
        raise


def _assemble(
    cfg: GatewayConfig, upstream: Upstream, pool: EnginePool, store: StateStore
) -> Runtime:
    scheduler = Scheduler(
        store=store,
        pool=pool,
        max_length=cfg.queue.max_length,
        kv_ceiling=cfg.admission.kv_ceiling,
        max_wait_s=cfg.queue.max_wait_s,
        retry_fallback_s=cfg.admission.retry_fallback_s,
        rate=ReleaseRate(cfg.admission.rate_window_s),
    )
    counters: dict[str, TokenCounter] = {}
    for model in pool.models():
        spec = cfg.tokenizer_for(model)

        def urls(model: str = model) -> list[str]:
            return [e.spec.url for e in pool.serving(model) if e.healthy]

        try:
            counters[model] = make_counter(
                spec,
                model=model,
                tokenize_urls=urls,
                client=upstream.tokenize_session() if spec == "engine" else None,
                timeout=upstream.tokenize_timeout,
            )
        except ValueError as e:  # e.g. an hf: directory that is not there
            raise ConfigError(f"models: {e}") from None
        log.info("model %s: token counter %s", model, spec)
    unserved = [m.name for m in cfg.models if m.name not in counters]
    if unserved:
        log.warning("configured models served by no engine: %s", unserved)
    service = Service(
        pool=pool,
        scheduler=scheduler,
        counters=counters,
        kv_ceiling=cfg.admission.kv_ceiling,
        reservation=cfg.admission.reservation,
        prediction=cfg.admission.prediction.policy(),
        adaptive=cfg.admission.adaptive.policy(),
        clamp=cfg.admission.over_length == "clamp",
    )

    async def own_loads() -> Mapping[str, EngineLoad] | None:
        try:
            return await store.loads()
        except StateUnavailable:
            return None

    monitor = EngineMonitor(pool, upstream.client, cfg.health, own_loads=own_loads)
    metrics = GatewayMetrics()
    exchanges = Exchanges(
        service=service, upstream=upstream, ejector=monitor, pool=pool, metrics=metrics
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
    return Runtime(
        cfg=cfg,
        upstream=upstream,
        pool=pool,
        store=store,
        scheduler=scheduler,
        service=service,
        auth=Authenticator(cfg.tenants),
        admin=admin,
        monitor=monitor,
        metrics=metrics,
        exchanges=exchanges,
    )
