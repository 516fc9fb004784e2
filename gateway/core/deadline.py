"""Admission by deadline (issue 40): which engines a request may go to now for its targets.

One more gate before the KV admission, never instead of it: the engines it leaves are the
request's candidates for the store, which still admits only where the blocks and sequences
fit (`worst_case` stays safe). Pure: the predictions (`gateway/core/latency.py`, fed by
`gateway/latency.py`) and the time already waited are passed in.

For each candidate engine the caller gives an `Outlook`: the request's predicted TTFT if it
were sent there now, the step time with it added (its TPOT, and every other sequence's
there), and the tightest TPOT target of the requests already running there. Then:

* a request with a TTFT target goes only where its predicted TTFT fits in what is left of
  its target (`ttft_s` − the time it has waited);
* a request with a TPOT target goes only where the step time with it added is within it;
* no request — with targets or without (best effort, `batch`) — goes where the step time
  with it added would break the tightest TPOT target of the requests running there: best
  effort fills what the targets leave;
* where no engine qualifies, a request with a TTFT target waits only while it still can:
  until what is left of its target is the TTFT it would have on an idle engine
  (`Outlook.idle_ttft_s`); when even that is gone it is refused at once
  (`Unattainable`), not after waiting. Without a TTFT target it waits as any request does
  (`queue.max_wait_s`).
* whether its turn can come in time at all is `out_of_reach`: the line of requests with
  targets ahead of it, at the rate engines take them, against how long it can wait while
  the engines stay as loaded as they are now (`Wait.likely_s`: an engine under overload
  stays loaded, so the idle TTFT is a bound, not an expectation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Outlook:
    """What sending the request to `engine` now would give (seconds)."""

    engine: str
    ttft_s: float
    """Its predicted time to first token there, from now."""
    step_s: float
    """The engine's step time with it added: its TPOT, and every running sequence's."""
    idle_ttft_s: float
    """Its TTFT on that engine with nothing running nor waiting: the least it can take."""
    tightest_tpot_s: float | None = None
    """The smallest TPOT target of the requests running there (None: none has one)."""


@dataclass(frozen=True, slots=True)
class Eligible:
    """Send it to one of these (the store picks among them by KV and routing)."""

    engines: frozenset[str]


@dataclass(frozen=True, slots=True)
class Wait:
    """No engine meets its targets now; look again within `for_s` at most (inf: no deadline
    of its own)."""

    for_s: float
    likely_s: float | None = None
    """How long it can wait and still make its TTFT target if the engines stay as loaded
    as now (what is left of the target less the least TTFT predicted now; may be < 0);
    None: as `for_s`."""

    @property
    def expected_s(self) -> float:
        """`likely_s`, or `for_s` when not given; never more than `for_s`."""
        return self.for_s if self.likely_s is None else min(self.likely_s, self.for_s)


@dataclass(frozen=True, slots=True)
class Unattainable:
    """It cannot meet its TTFT target on any engine, even one that is idle."""

    best_ttft_s: float
    """The least TTFT any engine could give it, from now."""
    left_s: float
    """What is left of its TTFT target."""


Verdict = Eligible | Wait | Unattainable


def decide(
    outlooks: Sequence[Outlook],
    *,
    ttft_s: float | None,
    tpot_s: float | None,
    waited_s: float = 0.0,
) -> Verdict:
    """The engines the request may go to now, how long it may wait, or that it cannot
    make its TTFT target at all. `ttft_s`/`tpot_s`: its targets (None: none);
    `waited_s`: how long it has waited since it arrived."""
    left = math.inf if ttft_s is None else ttft_s - waited_s
    fit = frozenset(o.engine for o in outlooks if _fits(o, left, tpot_s))
    if fit:
        return Eligible(fit)
    if ttft_s is None:
        return Wait(math.inf)
    best = min((o.idle_ttft_s for o in outlooks), default=math.inf)
    if best > left:
        return Unattainable(best, left)
    now = min((o.ttft_s for o in outlooks), default=math.inf)
    return Wait(left - best, likely_s=left - max(now, best))


def _fits(o: Outlook, left_s: float, tpot_s: float | None) -> bool:
    if o.ttft_s > left_s:
        return False
    if tpot_s is not None and o.step_s > tpot_s:
        return False
    return o.tightest_tpot_s is None or o.step_s <= o.tightest_tpot_s


def out_of_reach(
    wait: Wait, *, ahead: int, admitted_per_s: float | None, turn_s: float | None = None
) -> bool:
    """A request told to `wait` behind `ahead` others with targets cannot expect its turn
    before its deadline: its turn comes after `turn_s` seconds when the engines' running
    requests predict it (the `ahead + 1`-th of their predicted ends: each frees the room
    one waiting request takes), else after about `(ahead + 1) / admitted_per_s` (the
    recent rate at which requests left for engines, None: not known) — and that is later
    than `wait.expected_s` (how long it can wait if the engines stay as loaded as now).
    Then it is refused at once rather than after waiting for nothing. An estimate: without
    a predicted turn, never when the rate is unknown or nobody is ahead."""
    if math.isinf(wait.for_s):
        return False
    if turn_s is not None:
        return turn_s > wait.expected_s
    if ahead <= 0 or not admitted_per_s:
        return False
    return (ahead + 1) / admitted_per_s > wait.expected_s
