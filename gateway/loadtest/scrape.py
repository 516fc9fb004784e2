"""`/metrics` of the engines and of the gateway, scraped as time series during a run.

Engines: running, waiting, KV usage (fraction), preemptions (counter), parsed with the
gateway's own reader of vLLM pages (`gateway.engines.metrics`, both metric names of KV usage,
data-parallel ranks summed), and the prefix cache's queried and hit tokens
(`vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`, summed over labels; absent
on an engine without prefix caching). The gateway: queue length, reserved blocks, and its answers by
outcome. A scrape that fails is skipped (the series has a gap), never fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.engines.metrics import MetricsParseError, parse_page

PREFIX_QUERIES = "prefix_queries"
PREFIX_HITS = "prefix_hits"
_PREFIX_SAMPLES = {
    "vllm:prefix_cache_queries_total": PREFIX_QUERIES,
    "vllm:prefix_cache_hits_total": PREFIX_HITS,
}


def prefix_cache_counters(text: str) -> dict[str, float]:
    """The prefix cache's queried and hit tokens on an engine's page, summed over models and
    ranks; empty when the page has neither (prefix caching off, an older vLLM)."""
    out: dict[str, float] = {}
    with contextlib.suppress(ValueError):
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = _PREFIX_SAMPLES.get(s.name)
                if key is not None:
                    out[key] = out.get(key, 0.0) + s.value
    if not out:
        return {}
    return {PREFIX_QUERIES: out.get(PREFIX_QUERIES, 0.0), PREFIX_HITS: out.get(PREFIX_HITS, 0.0)}


class Scraper:
    def __init__(
        self,
        engines: tuple[str, ...],
        gateway: str | None,
        *,
        interval_s: float = 1.0,
        admin_key: str | None = None,
    ) -> None:
        self.engines = engines
        self.gateway = gateway
        self.interval_s = interval_s
        self._headers = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.engine_series: dict[str, list[dict[str, float]]] = {u: [] for u in engines}
        self.gateway_series: list[dict[str, Any]] = []
        self.num_gpu_blocks: dict[str, int] = {}
        self.errors = 0
        self._t0 = time.perf_counter()

    def client(self) -> httpx.AsyncClient:
        """An HTTP client for `run` and `scrape_once`. Make it before the run's clock starts:
        making one loads the CA certificates (~0.1 s of blocked event loop), which inside
        the run delayed its first sends."""
        return httpx.AsyncClient(timeout=max(2.0, self.interval_s * 2))

    async def run(self, http: httpx.AsyncClient, t0: float | None = None) -> None:
        """Scrape every `interval_s` until cancelled (t0: `perf_counter` of the run's start)."""
        self._t0 = t0 if t0 is not None else time.perf_counter()
        while True:
            started = time.perf_counter()
            await self.scrape_once(http)
            await asyncio.sleep(max(0.0, self.interval_s - (time.perf_counter() - started)))

    async def scrape_once(self, http: httpx.AsyncClient) -> None:
        jobs = [self._engine(http, url) for url in self.engines]
        if self.gateway:
            jobs.append(self._gateway(http, self.gateway))
        await asyncio.gather(*jobs)

    async def _page(self, http: httpx.AsyncClient, url: str) -> str | None:
        try:
            response = await http.get(url + "/metrics", headers=self._headers)
        except httpx.HTTPError:
            self.errors += 1
            return None
        if response.status_code != 200:
            self.errors += 1
            return None
        return response.text

    async def _engine(self, http: httpx.AsyncClient, url: str) -> None:
        at = time.perf_counter() - self._t0
        text = await self._page(http, url)
        if text is None:
            return
        try:
            page = parse_page(text)
        except MetricsParseError:
            self.errors += 1
            return
        if page.cache is not None:
            self.num_gpu_blocks[url] = page.cache.num_gpu_blocks
        models = list(page.models.values())
        if not models:
            return
        # A partial page (a gauge missing) counts the missing figure as 0.
        sample = {
            "t": round(at, 3),
            "running": sum(m.num_requests_running or 0 for m in models),
            "waiting": sum(m.num_requests_waiting or 0 for m in models),
            "kv_usage": max(m.kv_cache_usage or 0.0 for m in models),
            "preemptions": sum(m.num_preemptions_total or 0 for m in models),
        }
        sample.update(prefix_cache_counters(text))
        self.engine_series[url].append(sample)

    async def _gateway(self, http: httpx.AsyncClient, url: str) -> None:
        at = time.perf_counter() - self._t0
        text = await self._page(http, url)
        if text is None:
            return
        sample: dict[str, Any] = {"t": round(at, 3), "queue_length": 0.0, "reserved_blocks": 0.0}
        outcomes: dict[str, float] = {}
        with contextlib.suppress(ValueError):
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name == "kv_gateway_queue_length":
                        sample["queue_length"] = s.value
                    elif s.name == "kv_gateway_reserved_blocks":
                        sample["reserved_blocks"] += s.value
                    elif s.name == "kv_gateway_requests_total":
                        key = str(s.labels.get("outcome"))
                        outcomes[key] = outcomes.get(key, 0.0) + s.value
        sample["requests"] = outcomes
        self.gateway_series.append(sample)

    def _prefix_cache(self) -> dict[str, Any]:
        """Prefix-cache tokens queried and hit during the run, over every engine that
        exports them, and their ratio (None: no engine counted a query)."""
        queries = hits = 0.0
        found = False
        for series in self.engine_series.values():
            counted = [s for s in series if PREFIX_QUERIES in s]
            if counted:
                found = True
                queries += counted[-1][PREFIX_QUERIES] - counted[0][PREFIX_QUERIES]
                hits += counted[-1][PREFIX_HITS] - counted[0][PREFIX_HITS]
        if not found:
            return {}
        return {
            "prefix_cache_queries": int(queries),
            "prefix_cache_hits": int(hits),
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries > 0 else None,
        }

    def series(self) -> dict[str, Any]:
        return {"engines": self.engine_series, "gateway": self.gateway_series}

    def summary(self) -> dict[str, Any]:
        """Peaks over the run, and counters as the difference between the last and the first
        scrape (what happened during the run, not since the engine started)."""
        out: dict[str, Any] = {"scrape_errors": self.errors}
        samples = [s for series in self.engine_series.values() for s in series]
        if samples:
            out["peak_kv_usage"] = round(max(s["kv_usage"] for s in samples), 4)
            out["peak_running"] = int(max(s["running"] for s in samples))
            out["peak_waiting"] = int(max(s["waiting"] for s in samples))
            out["preemptions"] = int(
                sum(
                    series[-1]["preemptions"] - series[0]["preemptions"]
                    for series in self.engine_series.values()
                    if series
                )
            )
            out.update(self._prefix_cache())
        if self.num_gpu_blocks:
            out["num_gpu_blocks"] = dict(self.num_gpu_blocks)
        if self.gateway_series:
            first, last = self.gateway_series[0], self.gateway_series[-1]
            out["gateway_peak_queue"] = int(max(s["queue_length"] for s in self.gateway_series))
            out["gateway_answers"] = {
                k: int(v - first["requests"].get(k, 0.0)) for k, v in last["requests"].items()
            }
        return out
