"""One measured run against one target: the runner, the metrics scraper and the progress
display together, and the report they make (`report` dict: see docs/loadtest.md)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import httpx

from gateway.loadtest import cpu
from gateway.loadtest.aggregate import NO_SLO, Slo, summarize
from gateway.loadtest.client import Client
from gateway.loadtest.progress import Progress
from gateway.loadtest.prompts import PromptBuilder
from gateway.loadtest.records import RequestRecord
from gateway.loadtest.runner import RunConfig, Runner, RunResult
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
    client = Client(list(target.urls), timeout_s=timeout_s)
    result, load_start = await _run(client, cfg, builder, scraper, label or target.name, progress)
    return _report(
        target, cfg, result, result.records, scraper, load_start, slo, label or target.name, extra
    )


async def measure_mixed(
    targets: Sequence[Target],
    cfg: RunConfig,
    builder: PromptBuilder,
    *,
    slo: Slo = NO_SLO,
    labels: Sequence[str] | None = None,
    scrape_interval_s: float = 1.0,
    admin_key: str | None = None,
    progress: bool = True,
    timeout_s: float = 600.0,
    extra: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One run of `cfg` whose requests go to `targets` in turn (`compare --order mixed`),
    and a report per target from its own records: the targets take the same load at the
    same moments, so the machine's drift falls on each alike. The load in `cfg` is the
    total (each target gets 1/n of it). The metrics scraped (every target's engines, and
    the gateway's when there is one gateway) are shared by the reports."""
    if len({t.name for t in targets}) != len(targets):
        raise ValueError("mixed targets need distinct names")
    gateways = [t.gateway_metrics for t in targets if t.gateway_metrics]
    engines = tuple(dict.fromkeys(m for t in targets for m in t.engine_metrics))
    scraper = Scraper(
        engines,
        gateways[0] if len(gateways) == 1 else None,
        interval_s=scrape_interval_s,
        admin_key=admin_key,
    )
    client = Client(targets={t.name: t.urls for t in targets}, timeout_s=timeout_s)
    title = " + ".join(t.name for t in targets)
    result, load_start = await _run(client, cfg, builder, scraper, title, progress)
    names = list(labels) if labels is not None else [t.name for t in targets]
    return [
        _report(
            target,
            cfg,
            result,
            [r for r in result.records if r.target == target.name],
            scraper,
            load_start,
            slo,
            name,
            {**(extra or {}), "mixed_with": [t.name for t in targets if t is not target]},
        )
        for target, name in zip(targets, names, strict=True)
    ]


async def _run(
    client: Client,
    cfg: RunConfig,
    builder: PromptBuilder,
    scraper: Scraper,
    title: str,
    progress: bool,
) -> tuple[RunResult, list[float]]:
    bar = Progress(title, cfg.max_requests, cfg.duration_s) if progress else None
    loop = asyncio.get_running_loop()
    async with client, scraper.client() as http:
        runner = Runner(cfg, builder, client, on_record=bar.update if bar else None)
        with _on_sigint(loop, runner.stop):
            load_start = cpu.loadavg()
            scraping = asyncio.create_task(scraper.run(http, time.perf_counter()))
            try:
                result = await runner.run()
            finally:
                if bar is not None:
                    bar.close()
                scraping.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await scraping
        # One last scrape, more patient: counters at the end of the run.
        with contextlib.suppress(httpx.HTTPError, OSError):
            async with httpx.AsyncClient(timeout=5.0) as final:
                await scraper.scrape_once(final)
    return result, load_start


def _report(
    target: Target,
    cfg: RunConfig,
    result: RunResult,
    records: list[RequestRecord],
    scraper: Scraper,
    load_start: list[float],
    slo: Slo,
    label: str,
    extra: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "label": label,
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
        "summary": summarize(records, slo),
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
        "records": [r.to_dict() for r in records],
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
