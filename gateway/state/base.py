"""The shared-state port: leases on engines, tenant counters, and the waiting line.

Two adapters implement it — `memory.InMemoryStore` (one process, the embedded default) and
`redis.RedisStore` (several gateway replicas sharing one Redis) — and one conformance suite
(`tests/state/`) runs against both.

Contract:
- `try_admit` is atomic: tenant limits, engine capacity, the order of the waiting line,
  the choice of engine and the lease write are one step (one Lua script on Redis), so
  concurrent admissions — on any replica — never over-commit an engine or a tenant.
- An ask may take capacity only if no *queued* entry ordered before it competes for any of
  its engines ("no overtaking"); the order is priority class first, then weighted fair
  sharing across tenants (see `gateway.core.fairqueue`), then arrival.
- A refused ask charges nothing. Rate limits are charged when a lease is granted; tokens are
  charged up front (`ask.tokens`) and the difference refunded at `release(used_tokens=...)`.
- `release` is idempotent. Leases not renewed expire (a dead replica's capacity returns).
- Prefix credit: a candidate's footprint with a `prefix` costs, on its engine, only what live
  leases there do not hold of that prefix already (`Footprint.credited`, from the first
  block); the engine's reserved blocks count each held prefix block once, until the last
  lease holding it ends (`gateway.core.prefix.PrefixHolds`; the Lua scripts likewise).
- `extend` grows a live lease unconditionally (the blocks are in use already); a released
  or expired lease is not revived.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from gateway.core.routing import Candidate
from gateway.core.tenants import RateLimitValues
from gateway.core.types import DEFAULT_TENANT, EngineLoad, EngineView, Footprint, TenantPolicy


@dataclass(frozen=True, slots=True)
class Lease:
    """A reservation of `blocks` and `seqs` on `engine`, held until released (or expired).

    `tokens` is what was charged against the tenant's TPM at admission; `rates` are the
    tenant's rate limits as this admission left them (for the `x-ratelimit-*` headers, no
    second trip to the store), None when the tenant has no rate limit."""

    id: str
    engine: str
    blocks: int
    seqs: int
    tenant: str = "default"
    tokens: int = 0
    rates: RateLimitValues | None = field(default=None, compare=False)
    prompt_blocks: int = 0  # of `blocks`: its prompts' (`Footprint.prompt_blocks`)
    prefix: tuple[bytes, ...] = ()  # the prefix blocks it holds on `engine` (`Footprint.prefix`)
    credit: int = 0  # of them, held by other leases when it was admitted (not in `blocks`)

    @property
    def private_blocks(self) -> int:
        """Its blocks no other lease shares: `blocks` less the prefix blocks it was first to
        hold (those count once per engine, for as long as some lease holds them:
        `gateway.core.prefix.PrefixHolds`)."""
        return max(0, self.blocks + self.credit - len(self.prefix))

    @property
    def private_prompt_blocks(self) -> int:
        """Its prompt blocks no other lease shares (as `private_blocks`)."""
        return max(0, self.prompt_blocks + self.credit - len(self.prefix))


@dataclass(frozen=True, slots=True)
class AdmissionAsk:
    """Everything `try_admit` needs: the engines the request may use, in one of three forms.

    - `candidates`: one per engine, its view as the caller sees it and the request's
      footprint there (every engine is read at every decision).
    - The engine-set form (`engines` not None; what the scheduler sends; issue 14,
      docs/engine-index.md): the engines of `engines`, their views as last given with
      `set_views` (engines without one are left out); the request's footprint is `need` on
      each of them except the engines named in `exceptions` (another block size, blocks it
      expects cached there); `staged` False leaves out their staged sequence slots
      (`EngineView.staged_seqs`). The store decides how: it may keep the set as a group,
      ordered by free blocks, and decide without visiting every engine, or expand the ask
      into candidates (`EngineBook.candidates`); the result is the same.
    - The named form (`group` not None, with `need`, `exceptions` and `staged` as above):
      the engines of a group the caller named with a store's own `set_group` (not part of
      the port: tests and benchmarks that drive a store's groups directly).

    `tenant_max_blocks` is the tenant's `kv_share` turned into blocks by the caller (a
    fraction of all engines' usable blocks); None means no share limit. `queued` is True
    when the ask belongs to an entry placed with `enqueue` (it may then pass itself)."""

    lease_id: str
    candidates: tuple[Candidate, ...] = ()
    kv_ceiling: float = 1.0
    tenant: TenantPolicy = DEFAULT_TENANT
    tokens: int = 0
    tenant_max_blocks: int | None = None
    queued: bool = False
    group: str | None = None
    need: Footprint | None = None
    exceptions: tuple[tuple[str, Footprint], ...] = ()
    staged: bool = True
    engines: frozenset[str] | None = None


RefusalCode = Literal[
    "no_capacity",  # no engine has room now: wait
    "queued_ahead",  # others wait for these engines first: wait behind them
    "tenant_concurrency",
    "tenant_rpm",
    "tenant_tpm",
    "tenant_kv_share",
]
WAITABLE: frozenset[str] = frozenset({"no_capacity", "queued_ahead"})


@dataclass(frozen=True, slots=True)
class Behind:
    """The queued entry a `queued_ahead` ask waits behind: the nearest one ahead of it in
    line that competes for one of its engines and that it may not pass. Until that entry
    leaves the line (served, dequeued, expired) the ask stays behind it, whatever capacity
    frees, so its waiter sleeps until then (`StateStore.wait_behind`) instead of deciding
    again at every release.

    `expires_in_s`: when the entry's time is up unless its replica renews it (it then
    leaves at the next store call; a waiter looks again by then). `may_pass`: the ask could
    pass it later without it leaving: headroom on, and another tenant's entry, that tenant
    holding blocks (the headroom rule lets an ask within its share pass the entry of a
    tenant above its own, and a tenant holding nothing is above no share)."""

    entry_id: str
    expires_in_s: float
    may_pass: bool = False


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why an ask got no lease. `retry_after_s`: for rate limits, when there is room again.
    `behind`: for `queued_ahead`, the entry it waits behind (None where a store cannot say);
    not part of equality (the decision is the code)."""

    code: RefusalCode
    retry_after_s: float | None = None
    behind: Behind | None = field(default=None, compare=False)

    @property
    def waitable(self) -> bool:
        return self.code in WAITABLE


@dataclass(frozen=True, slots=True)
class QueueEntry:
    """A request waiting for capacity. `max_wait_s` bounds how long the entry may live."""

    id: str
    tenant: TenantPolicy
    engines: frozenset[str]
    blocks: int
    max_wait_s: float


RateLimitState = RateLimitValues
"""For the `x-ratelimit-*` headers; None where the tenant has no such limit."""


QueueVerdict = Literal["queued", "queue_full", "tenant_queue_full"]


class StateStore(Protocol):
    """The port the scheduler (and the status and metrics readers) sees. How a store keeps
    engines, groups of them, leases and the line is its own (memory.py, redis.py,
    fallback.py): its caller never learns which store it has.

    - Decisions: `try_admit`, `enqueue`, `dequeue`.
    - A lease's life: `release`, `renew`, `extend`.
    - What decisions read besides the ask: `set_views`.
    - Waiting: `wait_for_change`, `wait_behind`.
    - Reads (/admin/status, /metrics, the `x-ratelimit-*` headers, the 429's Retry-After):
      `queue_length`, `blocks_ahead`, `loads`, `rate_limits`, `degraded`.
    - `close`.

    While the shared state cannot be reached, `try_admit`, `enqueue` and the reads raise
    `gateway.state.errors.StateUnavailable` (503; the fail-open wrapper answers locally
    instead); `release`, `renew`, `extend` and `dequeue` never do (they run in `finally`),
    nor does `set_views` (what it could not give is given again before the next decision)."""

    async def try_admit(self, ask: AdmissionAsk) -> Lease | Refusal:
        """Reserve on the best engine of the ask that fits right now, or say why not: one
        atomic step (the module's contract). An ask in the engine-set form is decided
        exactly as the same ask with its engines as candidates."""
        ...

    async def set_views(self, views: Sequence[EngineView]) -> None:
        """The engines' views as the caller sees them now (what asks in the engine-set form
        are decided on; their `load` is ignored: the store has its own). Only the engines
        whose view changed need be given. A view of an engine that no longer caches
        prefixes (`EngineSpec.prefix_caching`, True in the view given before) makes the
        leases this store holds credited there whole: each is extended by its credit, once,
        before the call returns (the caller gives prefixes only for engines that cache)."""
        ...

    async def release(self, lease: Lease, used_tokens: int | None = None) -> bool:
        """Give the lease back; refund `lease.tokens − used_tokens` to the tenant's TPM.
        Idempotent: True the first time, False after. Never raises for a lost shared
        state (the release is sent later; the lease would expire anyway)."""
        ...

    async def renew(self, leases: Sequence[Lease]) -> None:
        """Keep running requests' leases alive (where leases expire). Never raises for a
        lost shared state."""
        ...

    async def extend(self, lease: Lease, blocks: int) -> Lease:
        """Add `blocks` to a running request's lease (it outgrew a predicted reservation),
        on its engine and its tenant; never refused, even past the ceiling: the engine holds
        them already. Returns the lease as now held (unchanged if it is gone). Never raises
        for a lost shared state (the lease then stays as it was)."""
        ...

    async def enqueue(self, entry: QueueEntry, max_length: int) -> QueueVerdict:
        """Join the waiting line (visible to every replica), unless it holds `max_length`
        entries, the tenant its `max_queued`, or the tenant above its share of the line
        would take its last places (docs/state.md, "Headroom")."""
        ...

    async def dequeue(self, entry_id: str) -> None:
        """Leave the waiting line (admitted, timed out or gone). Idempotent; never raises
        for a lost shared state."""
        ...

    async def queue_length(self) -> int:
        """Entries in the line now (every replica's)."""
        ...

    async def blocks_ahead(self, engines: frozenset[str]) -> int:
        """Blocks wanted by queued entries competing for any of `engines` (the 429's
        Retry-After: what the line holds ahead of a retry)."""
        ...

    async def rate_limits(self, tenant: TenantPolicy) -> RateLimitState:
        """The tenant's rate limits as they stand (the `x-ratelimit-*` headers)."""
        ...

    async def loads(self) -> dict[str, EngineLoad]:
        """Reserved blocks and sequences per engine; engines holding nothing may be absent."""
        ...

    async def wait_for_change(self, within_s: float) -> None:
        """Return when capacity may have changed anywhere (a release, on any replica) while
        someone waits in the line, or after `within_s` seconds. (Notices are for waiters,
        and every waiter has an entry: with the line empty a store may send none.)"""
        ...

    async def wait_behind(self, waiter_id: str, entry_id: str, within_s: float) -> None:
        """Return when the queued entry `entry_id` has left the line (served, dequeued or
        expired, on any replica), when `waiter_id`'s own entry may have moved ahead of it
        (an earlier entry of its tenant left unserved and the tenant's later entries moved
        up), or after `within_s` seconds. Returns at once when the store knows `entry_id`
        has left already. Targeted: a release wakes none of these waiters, an entry leaving
        wakes the ones behind it, so one admission causes one more decision, not one per
        waiter."""
        ...

    @property
    def degraded(self) -> bool:
        """True while the shared state cannot be reached (never, in-process)."""
        ...

    async def close(self) -> None:
        """Stop background work and wake every waiter; leases still held are not released
        (where leases expire, they do within their TTL)."""
        ...
