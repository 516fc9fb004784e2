"""A pure step model of vLLM v1's scheduler and KV block pool.

No asyncio, no I/O, no clock of its own: the caller passes ``now`` into every step and decides
when the next one starts (``step_seconds`` of the batch says how long it would take). The HTTP
server drives it on the real clock; ``gateway.sim.virtual.simulate`` drives it on a virtual one.

The model follows ``vllm/v1/core/sched/scheduler.py`` (FCFS policy) and ``kv_cache_manager.py``:

* The block pool (``gateway.sim.block_pool``) holds ``num_gpu_blocks`` blocks, one of which is
  vLLM's *null block*, so ``num_gpu_blocks - 1`` are usable and ``kv_cache_usage = 1 - free /
  (num_gpu_blocks - 1)``, where cached blocks no request references count as free.
* A request holds ``ceil(computed_tokens / block_size)`` blocks. Each step schedules, per
  request, the tokens not yet computed (the whole prompt, a chunk of it, or the one token
  sampled last step); blocks are taken for them before the step runs.
* With prefix caching (on by default, as vLLM v1), every full block a request computes is
  cached under a hash chained from the start of its tokens, the moment its blocks are taken
  (vLLM caches at allocation; decode blocks filled by generated tokens included). On admission
  the longest chain of cached blocks of the request's tokens is shared (reference counted) and
  not computed again, capped so that at least the last token is computed: at most
  ``(num_tokens - 1) // block_size`` blocks. Freed blocks keep their content until a new block
  is needed (LRU eviction), so a full cache evicts unreferenced cached blocks before anything is
  preempted.
* Running requests are served first, oldest first. When one cannot get its blocks, the newest
  running request is preempted (blocks freed, progress reset, put at the front of the waiting
  queue) until it can, or until it is itself the newest and gets preempted.
* Only if nothing was preempted this step, waiting requests are admitted FCFS while
  ``running < max_num_seqs`` and budget remains, each only if the blocks of its whole prompt
  (prompt + generated, on re-admission after preemption) are free; the first that does not fit
  stops admission (head-of-line blocking).
* At the end of a step every request whose tokens are all computed samples one new token; a
  request finishes when it has its planned number of output tokens and its blocks are freed.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from gateway.sim.block_pool import BlockHash, BlockPool, hash_block

FinishReason = Literal["stop", "length", "abort"]


class EngineError(ValueError):
    """A request or configuration the engine cannot accept."""


@dataclass(frozen=True)
class EngineLimits:
    """The scheduler and cache configuration of one engine (vLLM's flags of the same names).

    ``chunked_prefill`` is on by default as in vLLM v1: a prompt larger than the step's
    remaining budget is computed over several steps. With it off, a prompt is scheduled only
    when its whole remainder fits in the budget, and ``max_num_batched_tokens`` must be at
    least ``max_model_len`` (vLLM enforces the same at start-up). ``enable_prefix_caching`` is
    on by default as in vLLM v1; off, blocks are plain counters (nothing is shared or kept).
    """

    num_gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    chunked_prefill: bool = True
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise EngineError(f"{name} must be >= 1")
        if self.max_model_len < 2:
            raise EngineError("max_model_len must be >= 2")
        if self.usable_blocks < self.blocks_for(self.max_model_len):
            # vLLM refuses to start when one max_model_len request does not fit; we also count
            # the null block so that a lone request can always run to completion.
            raise EngineError(
                f"max_model_len {self.max_model_len} needs "
                f"{self.blocks_for(self.max_model_len)} blocks of {self.block_size} tokens, "
                f"but only {self.usable_blocks} of num_gpu_blocks {self.num_gpu_blocks} are "
                "usable (one is vLLM's null block); raise --num-gpu-blocks or lower "
                "--max-model-len"
            )
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise EngineError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len"
            )

    @property
    def usable_blocks(self) -> int:
        """Blocks requests can hold: all but vLLM's null block."""
        return max(self.num_gpu_blocks - 1, 0)

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)


@dataclass(frozen=True)
class StepTiming:
    """How long a step takes: prefill tokens × per-token cost + base + per-sequence cost × batch.

    All in milliseconds. ``batch`` is the number of sequences scheduled in the step (prefilling
    ones included), so a bigger batch makes every token slower, as on a real GPU.
    """

    prefill_ms_per_token: float = 0.02
    decode_ms_base: float = 2.0
    decode_ms_per_seq: float = 0.2

    def step_seconds(self, prefill_tokens: int, batch: int) -> float:
        if batch == 0:
            return 0.0
        ms = (
            prefill_tokens * self.prefill_ms_per_token
            + self.decode_ms_base
            + self.decode_ms_per_seq * batch
        )
        return ms / 1000.0


@dataclass(frozen=True)
class RequestSpec:
    """One sequence to generate: its prompt, its planned output, and how that output ends.

    ``finish_reason`` is what the request finishes with after ``num_output_tokens`` tokens:
    ``"stop"`` (the last one is EOS) or ``"length"`` (max_tokens reached). The token ids are
    what prefix caching hashes; ``RequestSpec.of_tokens`` builds a spec from them. Where they
    are left out (``None``) the content is unknown and treated as unique to this request: it
    shares no block with any other request, but a preempted request still finds its own cached
    blocks. ``cache_salt`` (vLLM's request field) is mixed into the first block's hash, so
    requests with different salts share nothing.
    """

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: Literal["stop", "length"] = "length"
    prompt_token_ids: tuple[int, ...] | None = None
    output_token_ids: tuple[int, ...] | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        ids, count = self.prompt_token_ids, self.num_prompt_tokens
        if ids is not None and len(ids) != count:
            raise EngineError(f"{len(ids)} prompt token ids for {count} prompt tokens")
        ids, count = self.output_token_ids, self.num_output_tokens
        if ids is not None and len(ids) != count:
            raise EngineError(f"{len(ids)} output token ids for {count} output tokens")

    @classmethod
    def of_tokens(
        cls,
        request_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        finish_reason: Literal["stop", "length"] = "length",
        *,
        cache_salt: str | None = None,
    ) -> RequestSpec:
        return cls(
            request_id,
            len(prompt_token_ids),
            len(output_token_ids),
            finish_reason,
            prompt_token_ids=tuple(prompt_token_ids),
            output_token_ids=tuple(output_token_ids),
            cache_salt=cache_salt,
        )


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"


@dataclass(eq=False)
class _Sequence:
    spec: RequestSpec
    arrival: float
    serial: int  # unique per engine: the identity of content whose token ids are unknown
    status: Status = Status.WAITING
    num_generated: int = 0
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks of block_ids already in the prefix cache
    block_hashes: list[BlockHash] = field(default_factory=list)  # memo, grows as needed
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission (vLLM's)
    num_preemptions: int = 0
    scheduled_at: float | None = None  # first admission (not re-admission after preemption)
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def num_tokens(self) -> int:
        return self.spec.num_prompt_tokens + self.num_generated

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def block_tokens(self, index: int, block_size: int) -> tuple[int, ...] | None:
        """Token ids of full block ``index`` (all known tokens), or None if any is unknown."""
        start, end = index * block_size, (index + 1) * block_size
        prompt_len = self.spec.num_prompt_tokens
        tokens: tuple[int, ...] = ()
        if start < prompt_len:
            if self.spec.prompt_token_ids is None:
                return None
            tokens = self.spec.prompt_token_ids[start : min(end, prompt_len)]
        if end > prompt_len:
            if self.spec.output_token_ids is None:
                return None
            tokens += self.spec.output_token_ids[max(start - prompt_len, 0) : end - prompt_len]
        return tokens


@dataclass(frozen=True)
class TokenEvent:
    """The ``index``-th output token (0-based) of a request was sampled at ``at``.

    ``since`` is the request's arrival for its first token and its previous token's time for
    the others, so ``at - since`` is what vLLM observes per output token: the time to first
    token, then the inter-token latency (a preemption's recomputation included).
    """

    request_id: str
    index: int
    at: float
    since: float


@dataclass(frozen=True)
class Finished:
    """A request that ended (``at``), with the times vLLM's per-request histograms measure.

    ``scheduled_at`` is its first admission (None if it never left the waiting queue),
    ``first_token_at`` and ``last_token_at`` its first and last output tokens (None if none).
    """

    request_id: str
    reason: FinishReason
    num_prompt_tokens: int
    num_output_tokens: int
    arrival: float
    first_token_at: float | None
    at: float
    num_preemptions: int
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    scheduled_at: float | None = None
    last_token_at: float | None = None


@dataclass(frozen=True)
class Batch:
    """What one step computes; returned by ``begin_step`` and passed back to ``end_step``."""

    started_at: float
    seconds: float
    scheduled: tuple[tuple[str, int], ...]  # (request id, tokens computed this step)
    prefill_tokens: int
    preempted: tuple[str, ...]

    @property
    def ends_at(self) -> float:
        return self.started_at + self.seconds


@dataclass(frozen=True)
class StepOutcome:
    """What a step produced. ``prompt_tokens_computed`` sums, over the requests whose first
    token came in this step, their prompt tokens not found in the prefix cache (vLLM counts a
    prompt's computed tokens with its first token, for ``vllm:iteration_tokens_total``)."""

    batch: Batch
    tokens: tuple[TokenEvent, ...]
    finished: tuple[Finished, ...]
    prompt_tokens_computed: int = 0


@dataclass(frozen=True)
class EngineSnapshot:
    """What vLLM's /metrics would show now."""

    running: int
    waiting: int
    used_blocks: int
    num_gpu_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    finished: dict[str, int] = field(default_factory=dict)
    peak_running: int = 0
    peak_used_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_cached: int = 0


@dataclass(frozen=True)
class RequestView:
    request_id: str
    status: str
    num_tokens: int
    num_computed_tokens: int
    num_blocks: int
    num_preemptions: int
    num_cached_tokens: int
    block_ids: tuple[int, ...]


class Engine:
    """The scheduler state of one engine. Not thread-safe; one driver owns it.

    Contract: ``used_blocks`` (blocks referenced by a request) ``<= num_gpu_blocks - 1`` and
    ``running <= max_num_seqs`` after every call; every added request ends exactly once in
    ``Finished`` (by finishing or by abort); with no request left, ``used_blocks == 0`` (cached
    blocks may remain, unreferenced, counted as free).
    """

    def __init__(self, limits: EngineLimits, timing: StepTiming | None = None) -> None:
        self.limits = limits
        self.timing = timing or StepTiming()
        self.block_pool = BlockPool(
            limits.usable_blocks, enable_caching=limits.enable_prefix_caching
        )
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._by_id: dict[str, _Sequence] = {}
        self._in_flight: Batch | None = None
        self._serial = 0
        self.num_preemptions = 0
        self.peak_running = 0
        self.peak_used_blocks = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished_counts: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        # vLLM's prefix-cache counters (tokens): first admissions only, preempted requests
        # re-admitted are not counted (vLLM keeps those apart and does not export them).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens_cached = 0

    # -- requests -------------------------------------------------------------------------

    def add(self, spec: RequestSpec, now: float) -> None:
        if spec.request_id in self._by_id:
            raise EngineError(f"duplicate request id {spec.request_id!r}")
        if spec.num_prompt_tokens < 1 or spec.num_output_tokens < 1:
            raise EngineError("a request needs at least one prompt and one output token")
        if spec.num_prompt_tokens + spec.num_output_tokens > self.limits.max_model_len:
            raise EngineError(
                f"prompt {spec.num_prompt_tokens} + output {spec.num_output_tokens} tokens "
                f"exceed max_model_len {self.limits.max_model_len}"
            )
        self._serial += 1
        seq = _Sequence(spec=spec, arrival=now, serial=self._serial)
        self._by_id[spec.request_id] = seq
        self._waiting.append(seq)

    def abort(self, request_id: str, now: float) -> Finished | None:
        """Remove a request wherever it is and free its blocks; None if it is not known."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        if seq in self._running:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        return self._finish(seq, "abort", now)

    # -- steps ----------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def begin_step(self, now: float) -> Batch:
        """Schedule one step: allocate blocks, preempt, admit. Tokens come in ``end_step``."""
        if self._in_flight is not None:
            raise EngineError("a step is already in flight")
        budget = self.limits.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        preempted: list[str] = []
        prefill_tokens = 0

        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            num_new = self._tokens_to_schedule(seq.num_tokens - seq.num_computed, budget)
            if num_new == 0:
                i += 1  # an unchunkable remainder; vLLM skips it this step
                continue
            while not self._allocate(seq, seq.num_computed + num_new):
                victim = self._running.pop()
                self._preempt(victim)
                preempted.append(victim.spec.request_id)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break
            scheduled[seq.spec.request_id] = num_new
            prefill_tokens += self._prefill_part(seq, num_new)
            budget -= num_new
            i += 1

        # vLLM admits nothing in a step that had to preempt.
        while (
            not preempted
            and self._waiting
            and len(self._running) < self.limits.max_num_seqs
            and budget > 0
        ):
            seq = self._waiting[0]
            hit = self._cache_hit(seq)
            if not self._fits(seq, hit):
                break  # head-of-line blocking: the whole prompt must fit
            num_hit_tokens = len(hit) * self.limits.block_size
            num_new = self._tokens_to_schedule(seq.num_tokens - num_hit_tokens, budget)
            if num_new == 0:
                break
            self._waiting.popleft()
            self._admit(seq, hit, num_new, now)
            scheduled[seq.spec.request_id] = num_new
            prefill_tokens += self._prefill_part(seq, num_new)
            budget -= num_new

        # Peaks of the scheduled state: what a test of "never more than …" needs, exactly.
        self.peak_running = max(self.peak_running, len(self._running))
        self.peak_used_blocks = max(self.peak_used_blocks, self.used_blocks)
        batch = Batch(
            started_at=now,
            seconds=self.timing.step_seconds(prefill_tokens, len(scheduled)),
            scheduled=tuple(scheduled.items()),
            prefill_tokens=prefill_tokens,
            preempted=tuple(preempted),
        )
        self._in_flight = batch
        return batch

    def end_step(self, batch: Batch, at: float | None = None) -> StepOutcome:
        """Apply a step's results at ``at``: sample tokens, finish requests.

        ``at`` defaults to ``batch.ends_at`` (a virtual clock); a driver on the real clock
        passes the time the step's results are in, which its sleep may have overshot.
        """
        if self._in_flight is not batch:
            raise EngineError("end_step of a batch that is not in flight")
        self._in_flight = None
        if at is None:
            at = batch.ends_at
        tokens: list[TokenEvent] = []
        finished: list[Finished] = []
        prompt_tokens_computed = 0
        for request_id, num_new in batch.scheduled:
            seq = self._by_id.get(request_id)
            if seq is None or seq.status is not Status.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed += num_new
            if seq.num_computed < seq.num_tokens:
                continue  # a chunk of a prefill; no token yet
            if seq.first_token_at is None:
                seq.first_token_at = at
                cached = seq.num_cached_tokens or 0
                self.prompt_tokens += seq.spec.num_prompt_tokens
                self.prompt_tokens_cached += cached
                prompt_tokens_computed += seq.spec.num_prompt_tokens - cached
                since = seq.arrival
            else:
                assert seq.last_token_at is not None
                since = seq.last_token_at
            tokens.append(TokenEvent(request_id, seq.num_generated, at, since))
            seq.last_token_at = at
            seq.num_generated += 1
            self.generation_tokens += 1
            if seq.num_generated >= seq.spec.num_output_tokens:
                self._running.remove(seq)
                finished.append(self._finish(seq, seq.spec.finish_reason, at))
        return StepOutcome(
            batch=batch,
            tokens=tuple(tokens),
            finished=tuple(finished),
            prompt_tokens_computed=prompt_tokens_computed,
        )

    def step(self, now: float) -> StepOutcome:
        """``begin_step`` then ``end_step``, for drivers that need nothing in between."""
        return self.end_step(self.begin_step(now))

    # -- observation ----------------------------------------------------------------------

    @property
    def used_blocks(self) -> int:
        """Blocks referenced by at least one request (shared blocks count once)."""
        return self.block_pool.num_used

    def kv_cache_usage(self) -> float:
        usable = self.limits.usable_blocks
        return 0.0 if usable == 0 else 1.0 - self.block_pool.num_free / usable

    @property
    def num_unfinished(self) -> int:
        """Sequences added and not yet ended (waiting or running)."""
        return len(self._by_id)

    def prefill_backlog_tokens(self) -> int:
        """Prompt tokens of the sequences that have not produced their first token yet.

        What vLLM's front door sums for ``--max-num-queued-tokens``: whole prompts, cached
        tokens and computed chunks included; a preempted sequence that already streamed a
        token is not in it (the front door never learns of preemption).
        """
        return sum(
            seq.spec.num_prompt_tokens for seq in self._by_id.values() if seq.first_token_at is None
        )

    def blocks_of(self, request_id: str) -> int | None:
        seq = self._by_id.get(request_id)
        return None if seq is None else seq.num_blocks

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            running=len(self._running),
            waiting=len(self._waiting),
            used_blocks=self.used_blocks,
            num_gpu_blocks=self.limits.num_gpu_blocks,
            kv_cache_usage=self.kv_cache_usage(),
            num_preemptions=self.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            finished=dict(self.finished_counts),
            peak_running=self.peak_running,
            peak_used_blocks=self.peak_used_blocks,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            prompt_tokens_cached=self.prompt_tokens_cached,
        )

    def requests(self) -> list[RequestView]:
        """Every live request, running ones first (oldest first), then the waiting queue."""
        return [
            RequestView(
                request_id=seq.spec.request_id,
                status=seq.status.value,
                num_tokens=seq.num_tokens,
                num_computed_tokens=seq.num_computed,
                num_blocks=seq.num_blocks,
                num_preemptions=seq.num_preemptions,
                num_cached_tokens=seq.num_cached_tokens or 0,
                block_ids=tuple(seq.block_ids),
            )
            for seq in [*self._running, *self._waiting]
        ]

    # -- internals ------------------------------------------------------------------------

    def _tokens_to_schedule(self, remaining: int, budget: int) -> int:
        if remaining <= budget:
            return remaining
        return budget if self.limits.chunked_prefill else 0

    def _prefill_part(self, seq: _Sequence, num_new: int) -> int:
        """Tokens of this step that compute known tokens rather than decode the last one."""
        is_decode = seq.num_generated > 0 and seq.num_computed == seq.num_tokens - 1
        return 0 if is_decode else num_new

    def _cache_hit(self, seq: _Sequence) -> list[int]:
        """Cached blocks the waiting ``seq`` would share; changes nothing.

        At least the last token is always computed (vLLM needs its logits), so at most
        ``(num_tokens - 1) // block_size`` blocks can hit.
        """
        if not self.limits.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.limits.block_size
        return self.block_pool.longest_hit(self._hashes(seq, max_blocks))

    def _fits(self, seq: _Sequence, hit: list[int]) -> bool:
        """Whether the blocks of ``seq``'s whole prompt can be had now (vLLM's admission).

        Hit blocks nobody references sit among the free ones; taking them out of the free
        queue costs a free block each, as in vLLM's ``allocate_slots``.
        """
        pool = self.block_pool
        new_blocks = self.limits.blocks_for(seq.num_tokens) - len(hit)
        revived = sum(1 for block_id in hit if pool.ref_count(block_id) == 0)
        return new_blocks + revived <= pool.num_free

    def _admit(self, seq: _Sequence, hit: list[int], num_new: int, now: float) -> None:
        num_hit_tokens = len(hit) * self.limits.block_size
        if seq.scheduled_at is None:  # vLLM's queue time ends at the first admission only
            seq.scheduled_at = now
        self.block_pool.touch(hit)
        seq.block_ids = list(hit)
        seq.num_cached_blocks = len(hit)
        seq.num_computed = num_hit_tokens
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_hit_tokens
        if self.limits.enable_prefix_caching and seq.num_preemptions == 0:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_hit_tokens
        allocated = self._allocate(seq, num_hit_tokens + num_new)
        assert allocated, "admitted a request whose blocks do not fit"
        seq.status = Status.RUNNING
        self._running.append(seq)

    def _allocate(self, seq: _Sequence, tokens: int) -> bool:
        """Blocks for ``tokens`` computed tokens of ``seq``; False (nothing taken) if short."""
        need = self.limits.blocks_for(tokens) - seq.num_blocks
        if need > self.block_pool.num_free:
            return False
        if need > 0:
            seq.block_ids.extend(self.block_pool.allocate(need))
        self._cache_full_blocks(seq, min(tokens, seq.num_tokens))
        return True

    def _cache_full_blocks(self, seq: _Sequence, tokens: int) -> None:
        """Cache every block of ``seq`` full within its first ``tokens`` tokens (vLLM caches
        at allocation: the step that computes them runs before anyone can read them)."""
        if not self.limits.enable_prefix_caching:
            return
        num_full = tokens // self.limits.block_size
        if num_full <= seq.num_cached_blocks:
            return
        hashes = list(self._hashes(seq, num_full))
        for index in range(seq.num_cached_blocks, num_full):
            self.block_pool.cache(seq.block_ids[index], hashes[index])
        seq.num_cached_blocks = num_full

    def _hashes(self, seq: _Sequence, num_blocks: int) -> Iterator[BlockHash]:
        """Hashes of ``seq``'s first ``num_blocks`` full blocks, computed once, lazily."""
        size = self.limits.block_size
        for index in range(num_blocks):
            if index == len(seq.block_hashes):
                parent = seq.block_hashes[-1] if seq.block_hashes else None
                extra: list[str] = []
                if index == 0 and seq.spec.cache_salt is not None:
                    extra.append(f"cache_salt:{seq.spec.cache_salt}")
                tokens = seq.block_tokens(index, size)
                if tokens is None:  # unknown content: unique to this sequence
                    tokens = ()
                    extra.append(f"opaque:{seq.serial}:{index}")
                seq.block_hashes.append(hash_block(parent, tokens, extra))
            yield seq.block_hashes[index]

    def _release(self, seq: _Sequence) -> None:
        # Tail blocks first, as vLLM frees them: a shared prefix outlives its suffixes.
        self.block_pool.free(reversed(seq.block_ids))
        seq.block_ids = []
        seq.num_cached_blocks = 0

    def _preempt(self, seq: _Sequence) -> None:
        self._release(seq)
        seq.status = Status.PREEMPTED
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(seq)

    def _finish(self, seq: _Sequence, reason: FinishReason, at: float) -> Finished:
        self._release(seq)
        del self._by_id[seq.spec.request_id]
        self.finished_counts[reason] += 1
        return Finished(
            request_id=seq.spec.request_id,
            reason=reason,
            num_prompt_tokens=seq.spec.num_prompt_tokens,
            num_output_tokens=seq.num_generated,
            arrival=seq.arrival,
            first_token_at=seq.first_token_at,
            at=at,
            num_preemptions=seq.num_preemptions,
            num_cached_tokens=seq.num_cached_tokens or 0,
            scheduled_at=seq.scheduled_at,
            last_token_at=seq.last_token_at,
        )
