"""Headroom: capacity a tenant above its fair share may not take while others are active.

The fair line decides *who goes next*; it cannot make room. Under a flood the engines are
always full and a request at the head of the line still waits for someone to finish: any
work-conserving order without preemption has that floor (docs/state.md, "Fairness,
measured"). Headroom closes it by keeping some capacity free for tenants under their share:

- A tenant is *active* if it holds blocks, has entries in the line, or was admitted or
  queued within the last `active_window_s` seconds.
- Its *fair share* is `weight / (weight + the other active tenants' weights)` of the
  capacity of the ask's candidate engines (the pool it competes in: tenants of another
  model on other engines neither give nor take room there).
- An admission that keeps the tenant within its fair share (`held + need ≤ share`, or the
  tenant holds nothing) is decided as before, and it is not held back by queued entries
  that would take *their* tenant above its share: those wait for headroom, and the room
  they wait for is this tenant's.
- An admission that takes the tenant above its share is allowed on an engine only if at
  least `headroom` × that engine's capacity stays free afterwards, **and** the pool keeps
  free what the other active tenants lack of their own shares (their *unused shares*);
  otherwise that engine is not a candidate for it (`no_capacity`: it waits, it is not
  refused). The second part is the sharing incentive of fair queuing: a tenant under its
  share gets up to its share at once, as it would on a static partition of the engines cut
  to its weight — a fixed headroom smaller than its next request (20 % of 242 blocks = 48,
  against requests of 58) could not promise that (docs/state.md, "Fairness, end to end").
- A *burst claim* (issue 18): a tenant holding blocks whose recent usage leaves room for one
  more request the size of its last within its share claims that request's blocks, and
  the pool keeps `max(unused share, claim)` for it. Only a holder near its share has a
  claim beyond its unused share (two 58-block requests under a share of 121: 58 claimed,
  5 unused); an admission within its tenant's share by a tenant already holding and no
  claimant itself (its usage with this request above its share) keeps such claims free
  whole (the unused part alone could be gone to it), so a flooder at its share waits
  while a quiet tenant with two requests running may start a third at once, instead of
  waiting for one of the four running to end.
- The waiting line has the same rule for its length: a tenant holding more than its
  weighted share of `max_length` entries (among the active tenants) may not take the line's
  last `headroom` × `max_length` places, so a flooder filling the line leaves room for the
  others' requests to wait instead of being refused `queue_full`.
- A tenant with nobody else active is never limited (`others_weight = 0`): the rule is
  work-conserving when there is nobody to protect. `headroom = 0` turns the rule off.

Pure: time is passed in; no I/O. The Redis adapter implements the same arithmetic in Lua
(gateway/state/lua/common.lua, `headroom_allows`); the conformance suite checks both.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

HEADROOM = 0.2
"""The default headroom, a fraction of each engine's capacity (0 turns the rule off)."""

ACTIVE_WINDOW_S = 30.0
"""The default time a tenant stays active after its last admission or enqueue. Long enough
that a tenant sending a request every few service times stays active between them: one
that goes inactive in a gap finds the others holding its share when it comes back, and
waits for one of their requests to end (issue 18: at 10 s, with 2.5 s requests every 4 s on
average, that was 8 % of the quiet tenant's requests and most of its p95 under a flood)."""

CLAIM_VISITS = 16
"""The most other holders whose burst claims one decision counts (the lowest claim keys
first; `burst_claim`): what a decision costs stays bounded whatever the tenants. Claims
beyond them are not kept free (the rule then errs towards using the capacity)."""


def check_headroom(headroom: float, active_window_s: float) -> None:
    """Raise ValueError for settings the rule cannot use."""
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    if not 0 <= active_window_s < float("inf"):
        raise ValueError(f"active_window_s must be >= 0 and finite, got {active_window_s}")


@dataclass(frozen=True, slots=True)
class Activity:
    """What the stores remember of a tenant for this rule."""

    weight: float
    last_seen: float
    """When the tenant was last admitted or queued (the store's clock)."""
    average: float = 0.0
    """Its recent usage: the blocks it held, averaged with weight `exp(−age / window)`."""
    stamp: float = 0.0
    """When `average` was last brought up to date (the held blocks were constant since)."""
    need: int = 0
    """The blocks of its last request (admitted or queued): the size of its burst claim."""


def average_at(activity: Activity | None, *, held: int, now: float, window: float) -> float:
    """The recent usage at `now`, given that the tenant has held `held` blocks since the last
    update: `held + (average − held) · exp(−(now − stamp) / window)`."""
    if activity is None:
        return 0.0 if window > 0 else float(held)
    if window <= 0:
        return float(held)
    decay = math.exp(-max(0.0, now - activity.stamp) / window)
    return held + (activity.average - held) * decay


def observe(
    activity: Activity | None,
    *,
    weight: float | None,
    held: int,
    now: float,
    window: float,
    need: int | None = None,
) -> Activity:
    """The record just before the tenant's held blocks change from `held`; `weight` is given
    when the tenant is seen (admitted or queued), None for a release; `need`: the blocks of
    the request it is seen with (None: the last one's, kept)."""
    average = average_at(activity, held=held, now=now, window=window)
    last = need if need is not None else (activity.need if activity is not None else 0)
    if weight is not None:
        return Activity(weight, now, average, now, last)
    assert activity is not None
    return Activity(activity.weight, activity.last_seen, average, now, last)


def is_active(activity: Activity, *, held: int, queued: int, now: float, window: float) -> bool:
    return held > 0 or queued > 0 or now - activity.last_seen <= window


def others_weight(weights: Iterable[tuple[str, float]], tenant: str) -> float:
    """The sum of the active tenants' weights except `tenant`'s, in the order given."""
    total = 0.0
    for name, weight in weights:
        if name != tenant:
            total += weight
    return total


def over_share(
    *, held: int, need: int, average: float, weight: float, total: float, capacity: int
) -> bool:
    """Whether an admission of `need` blocks counts as above the tenant's fair share
    `weight / total × capacity` (`total`: the active tenants' weights, its own included).

    Both what it would hold and its recent usage with this request must be above the
    share: a tenant whose recent usage leaves room for this request within its share may
    burst past it (it is the one headroom is kept for), and one that usually takes more gets
    back to its share at once. The request counts in the usage test too: without it a
    tenant capped just below its share (two requests of 58 under a share of 121) has an
    average below the share and bursts past it again and again (measured: the quiet
    tenant's p95 wait under a flood 0.39–0.42 s instead of ≤ 0.23 s). A tenant holding
    nothing is never above: its first request takes whatever fits, however large. Compared
    without dividing."""
    share = weight * capacity
    return held > 0 and (held + need) * total > share and (average + need) * total > share


def unused_share(*, held: int, weight: float, total: float, capacity: int) -> float:
    """What a tenant holding `held` blocks lacks of its fair share `weight / total ×
    capacity` (0 at or above it)."""
    return max(0.0, weight * capacity / total - held)


def burst_claim(
    *, held: int, average: float, need: int, weight: float, total: float, capacity: int
) -> tuple[float, float]:
    """A tenant's *burst claim* and what it adds to its unused share, `(claim, excess)`,
    both 0 unless the excess is positive: a tenant holding blocks whose recent usage (now)
    leaves room for one more request the size of its last (`need`) within its share
    `weight / total × capacity` claims that request's blocks, and the pool keeps free
    `max(unused share, claim)` for it. The excess is positive only for a holder near its
    share (two 58-block requests under a share of 121: the claim 58, the unused share 5,
    the excess 53); a tenant holding nothing has its whole share unused, at least its
    claim. The condition compared without dividing, as `over_share`."""
    if held <= 0 or need <= 0 or (average + need) * total > weight * capacity:
        return 0.0, 0.0
    unused = unused_share(held=held, weight=weight, total=total, capacity=capacity)
    excess = max(0.0, need - unused)
    return (float(need), excess) if excess > 0 else (0.0, 0.0)


def allows(
    *,
    held: int,
    need: int,
    average: float,
    weight: float,
    others: float,
    pool_capacity: int,
    free_after: int,
    engine_capacity: int,
    headroom: float,
    pool_free_after: int | None = None,
    others_unused: float = 0.0,
    others_excess: float = 0.0,
    others_claims: float = 0.0,
) -> bool:
    """Whether an admission of `need` blocks on one engine passes the headroom rule.

    `held`, `average`: the tenant's blocks now and its recent usage; `others`: the other
    active tenants' weights; `pool_capacity`: the capacity of all the ask's candidate
    engines; `free_after`: the engine's free blocks after this admission;
    `engine_capacity`: that engine's capacity; `pool_free_after`: the free blocks of all
    candidate engines after it (default: `free_after`, one engine); `others_unused`: the
    sum of the other active tenants' `unused_share`s of the pool; `others_excess`,
    `others_claims`: the sums of their `burst_claim`s' excesses and claims.

    Within its share, a tenant already holding blocks whose recent usage with this request
    is above its share (it is no claimant itself) keeps the others' claims free (those with
    an excess: a holder near its share): its request waits while such a tenant might
    burst. Claimants do not hold each other back (two would otherwise each keep the last
    free blocks from the other). Above
    its share, the headroom and the others' unused shares with their claims. A tenant's
    first request is never held back."""
    if headroom <= 0 or others <= 0:
        return True
    total = weight + others
    pool_free = free_after if pool_free_after is None else pool_free_after
    if not over_share(
        held=held, need=need, average=average, weight=weight, total=total, capacity=pool_capacity
    ):
        claimant = (average + need) * total <= weight * pool_capacity
        return held == 0 or claimant or pool_free >= others_claims
    return free_after >= headroom * engine_capacity and pool_free - others_excess >= others_unused


def line_allows(
    *, queued: int, length: int, max_length: int, weight: float, others: float, headroom: float
) -> bool:
    """Whether a tenant with `queued` entries may join a line of `length` (< `max_length`)
    entries: within its weighted share of `max_length` always; above it, only while the
    line's last `headroom × max_length` places stay free. Alone (`others` 0) or with
    `headroom` 0 it may take the whole line."""
    if headroom <= 0 or others <= 0:
        return True
    if (queued + 1) * (weight + others) <= weight * max_length:
        return True
    return length + 1 <= (1 - headroom) * max_length
