"""One measured run against one target: the runner, the metrics scraper and the progress
display together, and the report they make (`report` dict: see docs/loadtest.md)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from datetime import UTC, datetime
from typing import Any

import httpx

from gateway.loadtest import cpu
from gateway.loadtest.aggregate import NO_SLO, Slo, summarize
from gateway.loadtest.client import Client
from gateway.loadtest.progress import Progress
from gateway.loadtest.prompts import PromptBuilder
from gateway.loadtest.runner import RunConfig, Runner
from gateway.loadtest.scrape import Scraper
from gateway.loadtest.targets import Target


async def measure(
    target: Target,
    cfg: RunConfig,
    builder: PromptBuilder,
    *,
    slo: Slo = NO_SLO,
    label: str | None = None,
    scrape_interval_s: float = 1.0,
    admin_key: str | None = None,
    progress: bool = True,
    timeout_s: float = 600.0,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run `cfg` against `target` and return its report. Ctrl-C (SIGINT) stops the run;
    the report then has `interrupted: true` and what finished until then."""
    scraper = Scraper(
        target.engine_metrics,
        target.gateway_metrics,
        interval_s=scrape_interval_s,
        admin_key=admin_key,
    )
    bar = Progress(label or target.name, cfg.max_requests, cfg.duration_s) if progress else None
    loop = asyncio.get_running_loop()
    async with Client(list(target.urls), timeout_s=timeout_s) as client:
        runner = Runner(cfg, builder, client, on_record=bar.update if bar else None)
        with _on_sigint(loop, runner.stop):
            load_start = cpu.loadavg()
            scraping = asyncio.create_task(scraper.run(time.perf_counter()))
            try:
                result = await runner.run()
            finally:
                if bar is not None:
                    bar.close()
                scraping.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await scraping
            # One last scrape: counters at the end of the run.
            with contextlib.suppress(httpx.HTTPError, OSError):
                async with httpx.AsyncClient(timeout=5.0) as http:
                    await scraper.scrape_once(http)
    return {
        "label": label or target.name,
        "started": datetime.fromtimestamp(result.started_epoch, UTC).isoformat(),
        "target": {
            "name": target.name,
            "kind": target.kind,
            "urls": list(target.urls),
            "engine_metrics": list(target.engine_metrics),
            "gateway_metrics": target.gateway_metrics,
        },
        "model": cfg.model,
        "workload": {
            "tenants": [t.describe() for t in cfg.tenants]
            if not cfg.trace
            else [f"trace of {len(cfg.trace)} requests, {cfg.trace_arrivals.describe()}"]
            if cfg.trace_arrivals
            else [],
            "seed": cfg.seed,
            "max_requests": cfg.max_requests,
            "duration_s": cfg.duration_s,
            "warmup": cfg.warmup,
            "retry_429": cfg.retry_429,
        },
        **(extra or {}),
        "summary": summarize(result.records, slo),
        "metrics": {"summary": scraper.summary(), "series": scraper.series()},
        "client": {
            **result.client,
            "wall_s": round(result.wall_s, 3),
            "machine": cpu.machine(),
            "loadavg_start": load_start,
            "loadavg_end": cpu.loadavg(),
        },
        "warnings": result.warnings,
        "interrupted": result.interrupted,
        "records": [r.to_dict() for r in result.records],
    }


@contextlib.contextmanager
def _on_sigint(loop: asyncio.AbstractEventLoop, stop: Any) -> Any:
    try:
        loop.add_signal_handler(signal.SIGINT, stop)
        installed = True
    except (NotImplementedError, RuntimeError, ValueError):
        installed = False  # not the main thread, or not a Unix loop: Ctrl-C raises instead
    try:
        yield
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)
