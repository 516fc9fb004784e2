"""Plain facts the pure core decides on: engines, their load, a request's shape.

Everything here is a frozen value; the core never mutates what it is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What one vLLM engine can hold.

    `num_gpu_blocks` is vLLM's figure (`vllm:cache_config_info`, summed over `dp_size`
    data-parallel ranks); vLLM keeps one block per rank as the "null block". `max_num_seqs`
    is the engine's total (per-rank value × ranks). `models` are the model ids it serves.
    `prefix_caching`: the engine shares cached prompt blocks between requests
    (`vllm:cache_config_info`'s `enable_prefix_caching`, or configured). False when unknown:
    a request is credited with blocks other requests hold only where this is True, because
    an over-credit costs preemptions and an under-credit only throughput.
    """

    name: str
    url: str
    models: frozenset[str]
    num_gpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    dp_size: int = 1
    prefix_caching: bool = False

    @property
    def usable_blocks(self) -> int:
        """Blocks requests can get: each rank's block pool holds block 0 back as its null
        block. (`num_gpu_blocks` is vLLM's figure, summed over data-parallel ranks.)"""
        return max(0, self.num_gpu_blocks - self.dp_size)

    def capacity_blocks(self, kv_ceiling: float) -> int:
        """The most blocks the gateway lets reservations hold on this engine."""
        return int(self.usable_blocks * kv_ceiling)

    @property
    def rank_usable_blocks(self) -> int:
        """Usable blocks of one data-parallel rank: its pool is `num_gpu_blocks / dp_size`
        blocks, one of them its null block."""
        return max(0, self.num_gpu_blocks // self.dp_size - 1)

    def rank_capacity_blocks(self, kv_ceiling: float) -> int:
        """The most blocks one request may hold: vLLM runs a request (all its sequences) on
        one data-parallel rank. Equal to `capacity_blocks` without data parallelism."""
        return int(self.rank_usable_blocks * kv_ceiling)

    @property
    def rank_max_num_seqs(self) -> int:
        """Sequences one rank runs at most (`max_num_seqs` is the engine's total)."""
        return self.max_num_seqs // self.dp_size


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the gateway holds on one engine right now (its live leases, on every replica).

    `prompt_blocks` is the part of `reserved_blocks` the leases' requests hold for sure once
    the engine runs them: their prompts' blocks (× sequences). The gateway's estimate of its
    own actual use on the engine, which the foreign-load estimate subtracts from what the
    engine reports (`gateway/core/ledger.py`).
    """

    reserved_blocks: int = 0
    reserved_seqs: int = 0
    prompt_blocks: int = 0


@dataclass(frozen=True, slots=True)
class EngineView:
    """An engine as routing sees it at one instant.

    Ledger first: `load` is what the gateway holds on it right now (its own leases, on every
    replica), known without asking the engine, so blocks and sequence slots a request gives
    back are free at once. `foreign_blocks` and `foreign_seqs` are the load that is *not* the
    gateway's own — other clients, a restarted engine's leftovers — estimated at the engine's
    last scrape (`gateway/core/ledger.py`), 0 until it has been scraped:

        free_blocks = floor(kv_ceiling × usable_blocks) − reserved_blocks − foreign_blocks
        free_seqs   = max_num_seqs + staged_seqs − reserved_seqs − foreign_seqs

    `staged_seqs` (`admission.staged_seqs`) lets that many of the gateway's sequences wait
    inside the engine beyond `max_num_seqs`, their blocks reserved like any other: when a
    running sequence ends, the engine starts a staged one at its next step, as it does when
    clients send to it directly, instead of after a round trip through the gateway.

    Foreign use that hides inside the slack of the gateway's own worst-case reservations (a
    request reserved for 1,000 output tokens that has produced 10) is indistinguishable from
    the gateway's own in any scheme that reads only the engine's totals: it is counted as own.
    """

    spec: EngineSpec
    load: EngineLoad
    healthy: bool = True
    foreign_blocks: int = 0
    foreign_seqs: int = 0
    staged_seqs: int = 0

    def with_load(self, load: EngineLoad) -> EngineView:
        """This view with `load` (as `dataclasses.replace`, a few times faster: a store makes
        one per engine per decision). Keep in step with the fields above."""
        return EngineView(
            self.spec, load, self.healthy, self.foreign_blocks, self.foreign_seqs, self.staged_seqs
        )

    def free_blocks(self, kv_ceiling: float) -> int:
        used = self.load.reserved_blocks + self.foreign_blocks
        return self.spec.capacity_blocks(kv_ceiling) - used

    def free_seqs(self) -> int:
        return self.seq_slots - self.running

    @property
    def seq_slots(self) -> int:
        """Sequences the gateway may have on the engine: `max_num_seqs` + `staged_seqs`."""
        return self.spec.max_num_seqs + self.staged_seqs

    @property
    def running(self) -> int:
        """Sequences on the engine: the gateway's and the foreign ones."""
        return self.load.reserved_seqs + self.foreign_seqs


@dataclass(frozen=True, slots=True)
class RequestShape:
    """A request as admission sees it: tokens in, tokens it may produce, how many sequences.

    `prompt_tokens` has one entry per prompt (a completions request may batch several);
    `max_output_tokens` is what the client asked for (chat: `max_completion_tokens`, else
    `max_tokens`; completions: the larger of `max_tokens` and `max_completion_tokens`, as
    vLLM versions differ in which they read), or None when it asked for nothing. Then the
    engine's default applies: `default_output_tokens` (vLLM's completions default, 16, when
    `max_tokens` is left out) clamped to what fits, or, when that is None too (an explicit
    `null`, or chat), up to `max_model_len − prompt`.

    `generates` is False for requests that only read their prompts (embeddings, pooling,
    score, rerank, tokenize): no output is reserved and a prompt may fill the whole context.
    `holds_kv` is False for models that keep no KV cache for their prompts (encoder-only
    poolers): such a request takes sequence slots but no blocks.
    """

    prompt_tokens: tuple[int, ...]
    max_output_tokens: int | None
    n: int = 1
    default_output_tokens: int | None = None
    generates: bool = True
    holds_kv: bool = True


@dataclass(frozen=True, slots=True)
class Footprint:
    """A request's claim on one engine: the blocks reserved for it (the worst case, or less
    under a predicted reservation), its sequences, its worst-case tokens, and the blocks of
    its prompts (× sequences) — what it holds for sure once running (0: not known).

    Prefix caching (`gateway/core/prefix.py`): `prefix` are the hashes of its prompt's first
    full blocks that a cache hit could cover (at most `hit_cap`; empty when the gateway cannot
    tell: no token ids, media, several prompts); `credit` is how many of them a live lease on
    this engine already holds, already taken off `blocks` and `prompt_blocks` (the store sets
    it at admission, `credited`); `cached` is how many the engine is expected to have in its
    cache, held or not (the gateway's prefix index): blocks it need not compute, which
    routing may prefer (`most_free_after`) but admission never counts as free."""

    blocks: int
    seqs: int
    tokens: int
    prompt_blocks: int = 0
    prefix: tuple[bytes, ...] = ()
    credit: int = 0
    cached: int = 0

    def credited(self, held: int) -> Footprint:
        """This footprint with `held` of its prefix blocks already held on the engine (at most
        `len(prefix)`): those cost nothing more there."""
        credit = max(0, min(held, len(self.prefix)))
        return Footprint(
            blocks=self.blocks - credit,
            seqs=self.seqs,
            tokens=self.tokens,
            prompt_blocks=max(0, self.prompt_blocks - credit),
            prefix=self.prefix,
            credit=credit,
            cached=max(self.cached, credit),
        )

    def uncached(self) -> Footprint:
        """This footprint on an engine that caches no prefix: no credit may be given for its
        prompt and no cache hit expected (`EngineSpec.prefix_caching` off)."""
        if not self.prefix and not self.cached:
            return self
        return Footprint(self.blocks, self.seqs, self.tokens, self.prompt_blocks)


@dataclass(frozen=True, slots=True)
class ServiceClass:
    """A latency contract: TTFT and TPOT targets in seconds (None: no target).

    TTFT runs from the request's arrival at the gateway to its first token; TPOT is
    `(end − first token) / (output tokens − 1)`. A class without targets (`batch`) is best
    effort: it uses what the classes with targets leave. Targets MUST be finite and > 0."""

    name: str
    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for target in (self.ttft_s, self.tpot_s):
            if target is not None and not (math.isfinite(target) and target > 0):
                raise ValueError(f"service class {self.name!r}: targets must be > 0, not {target}")

    @property
    def has_targets(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """One tenant's contract. None means "no limit" for that dimension.

    `kv_share` is the most KV blocks the tenant may hold at once, as a fraction of all
    engines' usable blocks; `priority` classes are served strictly in order (higher first);
    `weight` is the tenant's share of capacity within its class; `max_queued` caps how many
    of its requests may wait at once. `service_class` is the latency contract of its
    requests that name none (None: no targets); `service_classes` are the classes its
    requests may name instead (`allowed_class`), its own included.
    """

    name: str = "default"
    max_concurrency: int | None = None
    rpm: int | None = None
    tpm: int | None = None
    kv_share: float | None = None
    priority: int = 0
    weight: float = 1.0
    max_queued: int | None = None
    service_class: ServiceClass | None = None
    service_classes: tuple[ServiceClass, ...] = ()

    def allowed_class(self, name: str) -> ServiceClass | None:
        """The class called `name` if this tenant's requests may name it; None if not."""
        own = self.service_class
        if own is not None and own.name == name:
            return own
        for allowed in self.service_classes:
            if allowed.name == name:
                return allowed
        return None


DEFAULT_TENANT = TenantPolicy()
"""Everyone's tenant when no tenants are configured."""
