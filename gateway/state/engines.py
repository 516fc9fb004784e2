"""The engines as a store knows them for asks in the engine-set or named form
(`AdmissionAsk.engines`, `AdmissionAsk.group`; issue 14, docs/engine-index.md): their views as
the scheduler last gave them (`StateStore.set_views`) and the groups the store keeps of
them (named by its `GroupCache`, groups.py, or by a test's `set_group`).

`EngineBook` only keeps them and expands such an ask into candidates (what a store that
scores every engine decides on; the Redis store keeps one to give Redis its views and
groups again when Redis lost them). `OrderedEngines` (the in-process store's) also keeps each
group's engines ordered by free blocks (`gateway.core.engine_order.EngineOrder`) with the
sums the headroom rule reads (the group's capacity and free blocks), moved as each
engine's load or view changes: a decision then finds the best engine without visiting the
others.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from gateway.core.engine_order import EngineOrder
from gateway.core.routing import Candidate
from gateway.core.types import EngineLoad, EngineView
from gateway.state.base import AdmissionAsk

_NO_LOAD = EngineLoad()


def unstaged(view: EngineView) -> EngineView:
    """The view without its staged sequence slots (`AdmissionAsk.staged` False)."""
    return replace(view, staged_seqs=0) if view.staged_seqs else view


@dataclass
class Group:
    """A named set of engines and the KV ceiling its asks use."""

    names: tuple[str, ...]  # sorted: the order candidates are offered in
    members: frozenset[str]
    kv_ceiling: float


class EngineBook:
    """Views and groups, as given; `candidates` expands a grouped ask."""

    def __init__(self) -> None:
        self.views: dict[str, EngineView] = {}
        self.groups: dict[str, Group] = {}

    def stopped_caching(self, views: Iterable[EngineView]) -> list[str]:
        """The engines of `views` that no longer cache prefixes though their kept view did
        (restarted with caching off): a lease credited there holds blocks the engine does not
        share, so the store makes it whole before it decides on them again."""
        gone = []
        for view in views:
            kept = self.views.get(view.spec.name)
            if kept is not None and kept.spec.prefix_caching and not view.spec.prefix_caching:
                gone.append(view.spec.name)
        return gone

    def set_views(self, views: Iterable[EngineView]) -> list[str]:
        """Keep these views (their load ignored); returns the engines whose view changed."""
        changed = []
        for view in views:
            name = view.spec.name
            kept = view.with_load(_NO_LOAD)
            if self.views.get(name) != kept:
                self.views[name] = kept
                changed.append(name)
        return changed

    def set_group(self, group: str, engines: frozenset[str], kv_ceiling: float) -> Group:
        made = Group(tuple(sorted(engines)), frozenset(engines), kv_ceiling)
        self.groups[group] = made
        return made

    def drop_group(self, group: str) -> None:
        """Forget a group (no error if it was never set)."""
        self.groups.pop(group, None)

    def group(self, ask_group: str) -> Group:
        got = self.groups.get(ask_group)
        if got is None:
            raise KeyError(f"engine group {ask_group!r} was never set (set_group)")
        return got

    def candidates(self, ask: AdmissionAsk, group: str | None = None) -> tuple[Candidate, ...]:
        """The candidates an ask in the engine-set or the named form stands for: each of its
        engines with a view, in name order, with its footprint there (`ask.need`, or its
        exception's). `group`: the group the store keeps of the ask's engine set, if any
        (its names are sorted already)."""
        assert ask.need is not None, "an ask with candidates already"
        named = group if group is not None else ask.group
        if named is not None:
            names: Iterable[str] = self.group(named).names
        else:
            assert ask.engines is not None, "an ask with candidates already"
            names = sorted(ask.engines)
        special = dict(ask.exceptions)
        out = []
        for name in names:
            view = self.views.get(name)
            if view is not None:
                view = view if ask.staged else unstaged(view)
                out.append(Candidate(view, special.get(name, ask.need)))
        return tuple(out)

    def expand(self, ask: AdmissionAsk, group: str | None = None) -> AdmissionAsk:
        """An ask in the engine-set or the named form as the same ask with candidates (`group`
        as for `candidates`); an ask with candidates as it is."""
        if ask.group is None and ask.engines is None:
            return ask
        return replace(
            ask,
            candidates=self.candidates(ask, group),
            group=None,
            engines=None,
            need=None,
            exceptions=(),
        )


@dataclass
class OrderedGroup(Group):
    """A group with its engines ordered by free blocks and the sums the headroom rule
    reads, kept as loads and views change."""

    order: EngineOrder = field(default_factory=EngineOrder)
    present: set[str] = field(default_factory=set)  # the members with a view: candidates
    capacity: int = 0  # the sum of the members' capacities (at `kv_ceiling`)
    free: int = 0  # the sum of the members' free blocks, each at least 0
    _capacity: dict[str, int] = field(default_factory=dict)
    _free: dict[str, int] = field(default_factory=dict)
    _sizes: Counter[int] = field(default_factory=Counter)
    _kinds: dict[tuple[int, int, int], int] = field(default_factory=dict)  # numbered
    _kind_of: dict[str, int] = field(default_factory=dict)

    @property
    def min_capacity(self) -> int:
        return min(self._sizes) if self._sizes else 0

    def place(self, name: str, view: EngineView | None) -> None:
        """`name`'s view is now `view` (its load the store's); None: no view (not a
        candidate)."""
        old_cap = self._capacity.pop(name, None)
        if old_cap is not None:
            self.capacity -= old_cap
            self.free -= self._free.pop(name)
            self._sizes[old_cap] -= 1
            if not self._sizes[old_cap]:
                del self._sizes[old_cap]
        if view is None:
            self.order.discard(name)
            self.present.discard(name)
            self._kind_of.pop(name, None)
            return
        self.present.add(name)
        cap = view.spec.capacity_blocks(self.kv_ceiling)
        self._capacity[name] = cap
        self._free[name] = 0
        self.capacity += cap
        self._sizes[cap] += 1
        # Its kind: what a decision reads of it besides its load (`EngineOrder.tied`).
        self._kind_of[name] = self._kinds.setdefault(
            (cap, view.spec.max_num_seqs, view.staged_seqs), len(self._kinds)
        )
        self.reload(name, view)

    def reload(self, name: str, view: EngineView) -> None:
        """`name`'s load changed (`view` carries it; the rest as last placed)."""
        load = view.load
        free = self._capacity[name] - load.reserved_blocks - view.foreign_blocks
        clipped = free if free > 0 else 0
        self.free += clipped - self._free[name]
        self._free[name] = clipped
        running = load.reserved_seqs + view.foreign_seqs
        slots = view.spec.max_num_seqs + view.staged_seqs
        self.order.set(name, free, running, view.healthy and slots > running, self._kind_of[name])


class OrderedEngines(EngineBook):
    """The in-process store's engines: `EngineBook` with each group ordered. `load_of` reads
    the store's reserved load of an engine; call `moved` whenever it changes."""

    def __init__(self, load_of: Callable[[str], EngineLoad]) -> None:
        super().__init__()
        self._load_of = load_of
        self.ordered: dict[str, OrderedGroup] = {}
        self._of: dict[str, list[OrderedGroup]] = {}  # engine -> the groups it belongs to

    def loaded(self, name: str) -> EngineView | None:
        """`name`'s view with the store's load on it; None without a view."""
        view = self.views.get(name)
        return None if view is None else view.with_load(self._load_of(name))

    def set_views(self, views: Iterable[EngineView]) -> list[str]:
        changed = super().set_views(views)
        for name in changed:
            view = self.loaded(name)
            for g in self._of.get(name, ()):
                g.place(name, view)
        return changed

    def set_group(self, group: str, engines: frozenset[str], kv_ceiling: float) -> Group:
        self.drop_group(group)
        made = OrderedGroup(tuple(sorted(engines)), frozenset(engines), kv_ceiling)
        self.groups[group] = made
        self.ordered[group] = made
        for name in made.names:
            self._of.setdefault(name, []).append(made)
            made.place(name, self.loaded(name))
        return made

    def drop_group(self, group: str) -> None:
        """Forget a group: its engines are no longer moved in it."""
        super().drop_group(group)
        old = self.ordered.pop(group, None)
        if old is not None:
            for name in old.names:
                kept = [g for g in self._of[name] if g is not old]
                if kept:
                    self._of[name] = kept
                else:
                    del self._of[name]

    def moved(self, name: str) -> None:
        """`name`'s load changed: move it in every group it belongs to."""
        groups = self._of.get(name)
        if groups:
            view = self.loaded(name)
            if view is not None:
                for g in groups:
                    g.reload(name, view)
