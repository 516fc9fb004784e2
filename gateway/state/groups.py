"""Which engine sets a store keeps as groups (issue 14, docs/engine-index.md).

An ask in the engine-set form (`AdmissionAsk.engines`) names no group: the store decides
whether to keep its engines as one, ordered by free blocks, so that a decision need not
read every engine. Each engine is moved in every group it belongs to at each change of its
load, so a store keeps few groups: at most `MAX_GROUPS`, and none no ask used for
`GROUP_IDLE_S`. `GroupCache` is that bound, kept the same way by every store; what a
group costs and how it is dropped is each store's own (memory.py, redis.py).
"""

from __future__ import annotations

import hashlib

MAX_GROUPS = 32
"""Engine sets a store keeps as groups (each model's, and the smaller sets of retries that
exclude an engine or of requests tied to one); an ask for another set is decided as one
candidate per engine, with the same result."""

GROUP_IDLE_S = 60.0
"""A group no ask used for this long is dropped: the sets of retries that excluded an
engine come and go, and each costs every change of its engines' load a move (figures in
docs/state.md, "Engine sets"). Named again when asked for again."""


def engine_group(engines: frozenset[str]) -> str:
    """The group name of a set of engines: the same on every replica (they share a group's
    keys on Redis), short enough for a Redis key."""
    return "g-" + hashlib.sha1("\n".join(sorted(engines)).encode()).hexdigest()[:16]


class GroupCache:
    """The engine sets named as groups, each with its last use, the least recently used
    first. One lookup per decision: `use`, then `idle` (which looks at one group unless
    some are to go)."""

    def __init__(self, max_groups: int = MAX_GROUPS, idle_s: float = GROUP_IDLE_S) -> None:
        self.max_groups = max_groups
        self.idle_s = idle_s
        self._used: dict[frozenset[str], tuple[str, float]] = {}

    def use(self, engines: frozenset[str], now: float) -> str | None:
        """The group of `engines`, used `now` (named now if it was not and there is room:
        the store sets up any group it does not hold); None when `max_groups` other sets
        are named (the ask goes as candidates)."""
        named = self._used.pop(engines, None)
        if named is not None:
            group = named[0]
        elif len(self._used) < self.max_groups:
            group = engine_group(engines)
        else:
            return None
        self._used[engines] = (group, now)  # now the most recently used
        return group

    def idle(self, now: float) -> str | None:
        """The least recently used group if no ask used it for `idle_s`, forgotten here
        (the store drops it); None when there is none. Called until it gives None."""
        if self._used:
            engines, (group, used) = next(iter(self._used.items()))
            if now - used >= self.idle_s:
                del self._used[engines]
                return group
        return None

    def __contains__(self, engines: object) -> bool:
        return engines in self._used

    def __len__(self) -> int:
        return len(self._used)
