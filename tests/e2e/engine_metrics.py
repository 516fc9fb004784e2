"""A snapshot of a real vLLM engine's `/metrics`, parsed with prometheus_client's parser."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class EngineMetrics:
    running: float
    waiting: float
    kv_cache_usage_perc: float
    num_preemptions_total: float
    num_gpu_blocks: int
    block_size: int

    @property
    def used_blocks(self) -> float:
        """Blocks held by requests, by vLLM's own definition of usage.

        vLLM's block pool keeps one of its `num_gpu_blocks` as the null block and reports
        `usage = 1 - free / (num_gpu_blocks - 1)`, so the blocks in use are
        `usage x (num_gpu_blocks - 1)`.
        """
        return self.kv_cache_usage_perc * (self.num_gpu_blocks - 1)


WANTED = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:num_preemptions",  # the family of vllm:num_preemptions_total
    "vllm:cache_config_info",
)


def _wanted_lines(text: str) -> str:
    """Only the families read here: a full page is ~50 KB of histograms, and parsing it whole
    takes long enough to miss the short peaks the tests sample for."""
    kept = []
    for line in text.splitlines():
        name = line.split(" ", 3)[2] if line.startswith("# ") else line.split("{", 1)[0]
        if name.split(" ", 1)[0].startswith(WANTED):
            kept.append(line)
    return "\n".join(kept) + "\n"


def parse(text: str) -> EngineMetrics:
    values: dict[str, float] = {}
    labels: dict[str, str] = {}
    for family in text_string_to_metric_families(_wanted_lines(text)):
        for sample in family.samples:
            # Summed over engines (data-parallel ranks); the tests run one.
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
            if sample.name == "vllm:cache_config_info":
                labels = dict(sample.labels)
    usage = values.get("vllm:kv_cache_usage_perc", values.get("vllm:gpu_cache_usage_perc"))
    if usage is None or "num_gpu_blocks" not in labels:
        raise AssertionError("vLLM /metrics lacks kv_cache_usage_perc or cache_config_info")
    return EngineMetrics(
        running=values["vllm:num_requests_running"],
        waiting=values["vllm:num_requests_waiting"],
        kv_cache_usage_perc=usage,
        num_preemptions_total=values["vllm:num_preemptions_total"],
        num_gpu_blocks=int(labels["num_gpu_blocks"]),
        block_size=int(labels["block_size"]),
    )


# The same registry, served without a worker thread. vLLM 0.32 answers `GET /metrics` with a
# synchronous handler that runs in a thread pool; while a request is generating, the API server's
# event loop keeps retaking the GIL and, on 2 busy cores, that thread can wait up to ~1 s. Its
# fallback mount for `/metrics/` (prometheus_client's ASGI app) runs on the event loop and
# answers in milliseconds. Watchers that sample during a request use it.
SAMPLING_PATH = "/metrics/"


def scrape(
    engine_url: str, client: httpx.Client | None = None, *, path: str = "/metrics"
) -> EngineMetrics:
    if client is None:
        with httpx.Client(timeout=10.0) as own:
            return scrape(engine_url, own, path=path)
    response = client.get(f"{engine_url}{path}")
    response.raise_for_status()
    return parse(response.text)


async def ascrape(
    engine_url: str, client: httpx.AsyncClient, *, path: str = "/metrics"
) -> EngineMetrics:
    response = await client.get(f"{engine_url}{path}")
    response.raise_for_status()
    return parse(response.text)
