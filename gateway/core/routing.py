"""Routing: filters → scorers → picker, over engine views.

A request may go only to engines that pass every filter (healthy, room for its blocks, a
free sequence slot). Among those, scorers rank them; the first scorer decides, later ones
break ties, and an injected chooser breaks what ties remain. The default is the product's
promise: the engine with the most free KV blocks *after* this request (`most_free_after`:
its footprint there is credited with the prefix blocks live leases hold, and the blocks the
engine is expected to cache count as saved), then the one with fewer running sequences.
Without prefixes it orders engines as `most_free_blocks` (free blocks before the request,
the old default, still selectable) does for equal footprints.

Each scorer is declared once, in `SCORERS`: its name, its score, and which key of the
engine order (`gateway.core.engine_order`) it ranks engines by, if any; the stores derive
from that whether a router can be decided from the order (`Router.ordered_by`). Adding a
scorer: docs/admission.md#adding-a-scorer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal, Protocol, TypeVar

from gateway.core.types import EngineView, Footprint

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One engine a request could go to, with what the request would claim there."""

    view: EngineView
    need: Footprint


def fits(candidate: Candidate, kv_ceiling: float) -> bool:
    """The filter: healthy, and room for the request's blocks and sequences right now."""
    view, need = candidate.view, candidate.need
    return (
        view.healthy
        and need.blocks <= view.free_blocks(kv_ceiling)
        and need.seqs <= view.free_seqs()
    )


Scorer = Callable[[Candidate, float], float]
"""A scorer maps (candidate, kv_ceiling) to a number; higher is better."""


def most_free_blocks(candidate: Candidate, kv_ceiling: float) -> float:
    """Free KV blocks left on the engine (absolute), before this request."""
    return float(candidate.view.free_blocks(kv_ceiling))


DEFAULT_CACHED_BLOCK_WEIGHT = 4.0
"""How many free blocks one block expected in an engine's prefix cache is worth to
`most_free_after` (`routing.cached_block_weight`)."""


def most_free_after(
    candidate: Candidate, kv_ceiling: float, cached_weight: float = DEFAULT_CACHED_BLOCK_WEIGHT
) -> float:
    """Free KV blocks left on the engine after this request, plus what its cache saves:
    its free blocks less what the request costs there (`need.blocks`, already credited with
    the prefix blocks live leases hold there: the memory saved), plus `cached_weight` for
    each block of its prompt the engine is expected to have cached, held or not
    (`need.cached`, which `Footprint.credited` keeps at least the credit): there the request
    skips computing them (the prefill saved, which free blocks elsewhere do not buy back;
    `routing.cached_block_weight` says what one is worth in free blocks). With no prefix
    known it orders engines as `most_free_blocks` does for an equal footprint."""
    need = candidate.need
    return candidate.view.free_blocks(kv_ceiling) - need.blocks + cached_weight * need.cached


def fewest_running(candidate: Candidate, kv_ceiling: float) -> float:
    """Fewer sequences running (reserved or reported) is better."""
    return -float(candidate.view.running)


def lowest_kv_fraction(candidate: Candidate, kv_ceiling: float) -> float:
    """Smallest fraction of the engine's capacity in use: evens out engines of unequal size."""
    view = candidate.view
    capacity = view.spec.capacity_blocks(kv_ceiling)
    if capacity <= 0:
        return -1.0
    return 1.0 - (capacity - view.free_blocks(kv_ceiling)) / capacity


OrderKey = Literal["free", "running"]
ORDER_KEYS: tuple[OrderKey, ...] = ("free", "running")
"""The engine order's keys, in its order (`gateway.core.engine_order`): most free blocks,
then fewest running sequences."""


@dataclass(frozen=True, slots=True)
class RoutingScorer:
    """A routing scorer, declared once. `ordered_by` is the key of the engine order that
    ranks engines as `score` does, or None. It MUST hold, for engines of any capacity given
    one footprint with nothing expected cached: `score` ranks them higher exactly when the
    key does ("free": more free blocks, "running": fewer running sequences) and equal
    exactly when the key ties (tests/core/test_routing.py checks it on random engines).
    `weighted`, for a scorer that reads `routing.cached_block_weight`: its score at a weight.
    The Redis store scores by the branch of this name in admit.lua's `score_of`."""

    name: str
    score: Scorer
    ordered_by: OrderKey | None
    weighted: Callable[[float], Scorer] | None = None

    def at_weight(self, cached_block_weight: float) -> Scorer:
        return self.score if self.weighted is None else self.weighted(cached_block_weight)


SCORERS: dict[str, RoutingScorer] = {
    s.name: s
    for s in (
        RoutingScorer("most_free_blocks", most_free_blocks, ordered_by="free"),
        RoutingScorer(
            "most_free_after",
            most_free_after,
            ordered_by="free",  # with nothing cached: free − need, one need for all
            weighted=lambda weight: partial(most_free_after, cached_weight=weight),
        ),
        RoutingScorer("fewest_running", fewest_running, ordered_by="running"),
        RoutingScorer("lowest_kv_fraction", lowest_kv_fraction, ordered_by=None),
    )
}
DEFAULT_SCORERS: tuple[str, ...] = ("most_free_after", "fewest_running")


def ordered_ranking(scorer_names: Sequence[str]) -> OrderKey | None:
    """How far down its keys the engine order ranks engines as these scorers do: "free"
    (by most free blocks alone), "running" (then by fewest running), or None (the scorers'
    keys are not the order's first keys, in its order: every engine must be scored)."""
    keys = tuple(SCORERS[name].ordered_by for name in scorer_names)
    return keys[-1] if keys and keys == ORDER_KEYS[: len(keys)] else None


class Chooser(Protocol):
    """Breaks the last ties; `random.Random(seed)` is one."""

    def choice(self, seq: Sequence[T]) -> T: ...


class Router:
    """Picks an engine for a request, or None when it fits nowhere right now."""

    def __init__(
        self,
        scorer_names: Sequence[str] = DEFAULT_SCORERS,
        *,
        cached_block_weight: float = DEFAULT_CACHED_BLOCK_WEIGHT,
    ) -> None:
        unknown = [name for name in scorer_names if name not in SCORERS]
        if unknown:
            raise ValueError(f"unknown routing scorer(s) {unknown}; known: {sorted(SCORERS)}")
        if not scorer_names:
            raise ValueError("routing needs at least one scorer")
        if not cached_block_weight >= 0:
            raise ValueError(f"cached_block_weight must be >= 0, not {cached_block_weight}")
        self.scorer_names = tuple(scorer_names)
        self.cached_block_weight = float(cached_block_weight)
        self._scorers = tuple(
            SCORERS[name].at_weight(self.cached_block_weight) for name in scorer_names
        )
        # Whether, and down to which key, the engine order ranks engines as this router
        # does (the stores' ordered path; docs/engine-index.md).
        self.ordered_by = ordered_ranking(self.scorer_names)

    def score(self, candidate: Candidate, kv_ceiling: float) -> tuple[float, ...]:
        """The candidate's score by each scorer in turn (higher is better)."""
        return tuple(s(candidate, kv_ceiling) for s in self._scorers)

    def pick(
        self, candidates: Sequence[Candidate], kv_ceiling: float, chooser: Chooser
    ) -> Candidate | None:
        eligible = [c for c in candidates if fits(c, kv_ceiling)]
        if not eligible:
            return None
        scored = [(self.score(c, kv_ceiling), c) for c in eligible]
        best = max(score for score, _ in scored)
        return chooser.choice([c for score, c in scored if score == best])
