"""Plain facts the pure core decides on: engines, their load, a request's shape.

Everything here is a frozen value; the core never mutates what it is given.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What one vLLM engine can hold.

    `num_gpu_blocks` is vLLM's figure (`vllm:cache_config_info`); vLLM keeps one of them as
    the "null block", so `usable_blocks` is one less. `models` are the model ids it serves.
    """

    name: str
    url: str
    models: frozenset[str]
    num_gpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int

    @property
    def usable_blocks(self) -> int:
        """Blocks requests can get: vLLM's block pool holds block 0 back as the null block."""
        return max(0, self.num_gpu_blocks - 1)

    def capacity_blocks(self, kv_ceiling: float) -> int:
        """The most blocks the gateway lets reservations hold on this engine."""
        return int(self.usable_blocks * kv_ceiling)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the gateway has reserved on one engine right now."""

    reserved_blocks: int = 0
    reserved_seqs: int = 0


@dataclass(frozen=True, slots=True)
class EngineView:
    """An engine as routing sees it at one instant: its spec, the gateway's reservations on
    it, and whether it may take traffic. `external_blocks` are blocks the engine reports in
    use beyond the gateway's own reservations (traffic around the gateway); 0 until the
    engine is scraped."""

    spec: EngineSpec
    load: EngineLoad
    healthy: bool = True
    external_blocks: int = 0
    external_seqs: int = 0

    def free_blocks(self, kv_ceiling: float) -> int:
        used = self.load.reserved_blocks + self.external_blocks
        return self.spec.capacity_blocks(kv_ceiling) - used

    def free_seqs(self) -> int:
        return self.spec.max_num_seqs - self.load.reserved_seqs - self.external_seqs


@dataclass(frozen=True, slots=True)
class RequestShape:
    """A request as admission sees it: tokens in, tokens it may produce, how many sequences.

    `prompt_tokens` has one entry per prompt (a completions request may batch several);
    `max_output_tokens` is what the client asked for (`max_completion_tokens`, else
    `max_tokens`), or None when it asked for nothing, in which case vLLM may generate up to
    `max_model_len − prompt`.
    """

    prompt_tokens: tuple[int, ...]
    max_output_tokens: int | None
    n: int = 1


@dataclass(frozen=True, slots=True)
class Footprint:
    """A request's worst-case claim on one engine."""

    blocks: int
    seqs: int
    tokens: int


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """One tenant's contract. None means "no limit" for that dimension.

    `kv_share` is the most KV blocks the tenant may hold at once, as a fraction of all
    engines' usable blocks; `priority` classes are served strictly in order (higher first);
    `weight` is the tenant's share of capacity within its class; `max_queued` caps how many
    of its requests may wait at once.
    """

    name: str = "default"
    max_concurrency: int | None = None
    rpm: int | None = None
    tpm: int | None = None
    kv_share: float | None = None
    priority: int = 0
    weight: float = 1.0
    max_queued: int | None = None
