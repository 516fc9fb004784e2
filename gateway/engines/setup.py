"""Settle each configured engine's spec at start-up: configured values, else discovered ones.

An engine whose numbers are all configured (models included) is not asked anything; the
others are asked once for `/v1/models` and `/metrics`. Every value is logged with its source.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from gateway.config import EngineConfig, GatewayConfig
from gateway.core.types import EngineSpec
from gateway.engines.discovery import (
    DiscoveredEngine,
    DiscoveryError,
    discover,
    resolve_engine_limits,
    resolve_prefix_caching,
)

log = logging.getLogger(__name__)

Sources = dict[str, str]


def _needs_discovery(e: EngineConfig) -> bool:
    return e.models is None or None in (e.num_gpu_blocks, e.block_size, e.max_model_len)


async def resolve_engine(e: EngineConfig, client: httpx.AsyncClient) -> tuple[EngineSpec, Sources]:
    discovered: DiscoveredEngine | None = None
    if _needs_discovery(e):
        discovered = await discover(client, e.url)
    configured = {
        "num_gpu_blocks": e.num_gpu_blocks,
        "block_size": e.block_size,
        "max_num_seqs": e.max_num_seqs,
        "max_model_len": e.max_model_len,
    }
    values, sources = resolve_engine_limits(configured, discovered, e.platform)
    if e.models is not None:
        models, sources["models"] = frozenset(e.models), "config"
    else:
        assert discovered is not None
        models, sources["models"] = frozenset(discovered.model_ids), "discovered:/v1/models"
    if not models:
        raise DiscoveryError(e.url, "the engine serves no model")
    prefix_caching, sources["prefix_caching"] = resolve_prefix_caching(e.prefix_caching, discovered)
    spec = EngineSpec(
        name=e.display_name,
        url=e.url,
        models=models,
        num_gpu_blocks=values["num_gpu_blocks"],
        block_size=values["block_size"],
        # vLLM's max_num_seqs is per data-parallel rank; each rank schedules its own.
        max_num_seqs=values["max_num_seqs"] * values["dp_size"],
        max_model_len=values["max_model_len"],
        dp_size=values["dp_size"],
        prefix_caching=prefix_caching,
    )
    for key in (
        "models",
        "num_gpu_blocks",
        "block_size",
        "max_num_seqs",
        "max_model_len",
        "prefix_caching",
    ):
        value = sorted(models) if key == "models" else values.get(key, getattr(spec, key))
        log.info("engine %s: %s = %s (%s)", spec.name, key, value, sources[key])
    return spec, sources


async def resolve_engines(
    cfg: GatewayConfig, client: httpx.AsyncClient
) -> tuple[list[EngineSpec], dict[str, Sources]]:
    """All engines' specs, discovered concurrently; raises `DiscoveryError` naming the engine."""
    results = await asyncio.gather(*(resolve_engine(e, client) for e in cfg.engines))
    return [spec for spec, _ in results], {spec.name: src for spec, src in results}
