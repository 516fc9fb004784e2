import dataclasses
import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.routing import (
    DEFAULT_CACHED_BLOCK_WEIGHT,
    ORDER_KEYS,
    SCORERS,
    Candidate,
    Router,
    fits,
    ordered_ranking,
)
from gateway.core.types import EngineLoad, EngineSpec, EngineView, Footprint


def spec(name, blocks=101, seqs=8):
    return EngineSpec(name, f"http://{name}", frozenset({"m"}), blocks, 16, seqs, 2048)


def cand(
    name, reserved=0, running=0, need=10, blocks=101, seqs=8, healthy=True, foreign=0, fseqs=0
):
    view = EngineView(
        spec(name, blocks, seqs), EngineLoad(reserved, running), healthy, foreign, fseqs
    )
    return Candidate(view, Footprint(blocks=need, seqs=1, tokens=need * 16))


def test_most_free_blocks_wins():
    router = Router()
    picked = router.pick([cand("a", reserved=50), cand("b", reserved=10)], 1.0, random.Random(0))
    assert picked is not None and picked.view.spec.name == "b"


def test_tie_broken_by_fewer_running_then_chooser():
    router = Router()
    a, b = cand("a", reserved=10, running=3), cand("b", reserved=10, running=1)
    assert router.pick([a, b], 1.0, random.Random(0)).view.spec.name == "b"
    c, d = cand("c"), cand("d")
    seen = {router.pick([c, d], 1.0, random.Random(seed)).view.spec.name for seed in range(20)}
    assert seen == {"c", "d"}  # the chooser decides the last ties, both ways


@pytest.mark.parametrize(
    ("candidate", "ok"),
    [
        (cand("a", reserved=90, need=10), True),  # 100 usable blocks exactly
        (cand("a", reserved=91, need=10), False),
        (cand("a", running=8), False),  # max_num_seqs reached
        (cand("a", healthy=False), False),
        (cand("a", foreign=91, need=10), False),  # traffic around the gateway counts
        (cand("a", foreign=90, need=10), True),
        (cand("a", reserved=50, foreign=40, need=10), True),  # ledger + foreign, exactly full
        (cand("a", reserved=50, foreign=41, need=10), False),  # both count: never their max
        (cand("a", running=6, fseqs=1), True),  # 7 of 8 slots taken, one left
        (cand("a", running=6, fseqs=2), False),  # foreign sequences take slots too
    ],
)
def test_fits(candidate, ok):
    assert fits(candidate, 1.0) is ok


def test_staged_sequences_are_slots_beyond_max_num_seqs():
    # admission.staged_seqs: that many of the gateway's sequences may wait inside the engine.
    def staged(running: int, fseqs: int = 0) -> Candidate:
        view = EngineView(spec("a"), EngineLoad(0, running), True, 0, fseqs, staged_seqs=2)
        return Candidate(view, Footprint(blocks=1, seqs=1, tokens=16))

    assert staged(0).view.seq_slots == 10
    assert fits(staged(9), 1.0) and not fits(staged(10), 1.0)
    assert fits(staged(8, fseqs=1), 1.0) and not fits(staged(8, fseqs=2), 1.0)


def test_ceiling_and_null_block():
    # 101 blocks → 100 usable (vLLM's null block); ceiling 0.5 → 50.
    assert spec("a").capacity_blocks(0.5) == 50
    assert fits(cand("a", reserved=40, need=10), 0.5)
    assert not fits(cand("a", reserved=41, need=10), 0.5)


def test_nothing_fits_gives_none():
    assert Router().pick([cand("a", reserved=100)], 1.0, random.Random(0)) is None


def test_unknown_scorer_is_rejected():
    with pytest.raises(ValueError, match="unknown routing scorer"):
        Router(["nope"])


def test_lowest_kv_fraction_prefers_the_emptier_engine_by_share():
    router = Router(["lowest_kv_fraction"])
    big = cand("big", reserved=100, blocks=1001)  # 10% used
    small = cand("small", reserved=20, blocks=101)  # 20% used
    assert router.pick([big, small], 1.0, random.Random(0)).view.spec.name == "big"


def _prefixed(name: str, reserved: int, need: int, credit: int = 0, cached: int = 0) -> Candidate:
    view = EngineView(spec(name), EngineLoad(reserved, 0))
    base = Footprint(blocks=need, seqs=1, tokens=need * 16, prefix=(b"x",) * 8, cached=cached)
    return Candidate(view, base.credited(credit))


def test_most_free_after_prefers_where_the_prefix_is_held_when_it_saves_enough() -> None:
    router = Router(["most_free_after"], cached_block_weight=1)
    # 8 of its 20 blocks held on "a": 100 − 67 − 12 + 8 = 29 after, against 100 − 50 − 20 = 30
    # on b (the credit saves 8 blocks of memory and 8 of prefill, not the 17 more used on a).
    a, b = _prefixed("a", 67, 20, credit=8), _prefixed("b", 50, 20)
    assert router.pick([a, b], 1.0, random.Random(0)).view.spec.name == "b"
    a = _prefixed("a", 65, 20, credit=8)  # 31: the saving outweighs the 15 blocks
    assert router.pick([a, b], 1.0, random.Random(0)).view.spec.name == "a"
    # Cached but unheld blocks count for routing only: "c" is no freer, yet preferred.
    c = _prefixed("c", 50, 20, cached=4)
    assert c.need.blocks == 20 and router.pick([b, c], 1.0, random.Random(0)).view.spec.name == "c"


def test_the_cached_block_weight_says_what_a_cached_block_is_worth() -> None:
    # "c" has 30 blocks fewer free but 4 of the prompt cached: 100 − 80 − 20 + 4w vs 30.
    b, c = _prefixed("b", 50, 20), _prefixed("c", 80, 20, cached=4)
    picks = {
        w: Router(["most_free_after"], cached_block_weight=w).pick([b, c], 1.0, random.Random(0))
        for w in (1, 7, 8)
    }
    assert {w: p.view.spec.name for w, p in picks.items() if p} == {1: "b", 7: "b", 8: "c"}
    with pytest.raises(ValueError, match="cached_block_weight"):
        Router(["most_free_after"], cached_block_weight=-1)


def test_without_a_prefix_most_free_after_orders_as_most_free_blocks() -> None:
    cands = [cand(n, reserved=r) for n, r in (("a", 10), ("b", 40), ("c", 25))]
    for scorer in ("most_free_blocks", "most_free_after"):
        ranked = sorted(cands, key=lambda c: -SCORERS[scorer].score(c, 1.0))
        assert [c.view.spec.name for c in ranked] == ["a", "c", "b"]


def test_credit_is_capped_by_the_prefix_and_comes_off_the_prompt_blocks() -> None:
    need = Footprint(blocks=30, seqs=1, tokens=480, prompt_blocks=10, prefix=(b"h",) * 6)
    assert need.credited(4) == Footprint(30 - 4, 1, 480, 6, need.prefix, credit=4, cached=4)
    assert need.credited(99).credit == 6 and need.credited(-1).credit == 0


def test_with_load_is_replace_of_the_load() -> None:
    """`EngineView.with_load` keeps every other field (a field added to EngineView and
    forgotten there fails here)."""
    spec = EngineSpec("e", "http://e", frozenset({"m"}), 11, 16, 8, 2048)
    values = {"healthy": False, "foreign_blocks": 3, "foreign_seqs": 2, "staged_seqs": 1}
    view = EngineView(spec, EngineLoad(), **values)
    assert {f.name for f in dataclasses.fields(EngineView)} == {"spec", "load", *values}
    load = EngineLoad(5, 1, 2)
    assert view.with_load(load) == dataclasses.replace(view, load=load)


# Engines of any size and load, as the engine order holds them (`gateway/state/engines.py`).
engine = st.builds(
    lambda blocks, seqs, staged, reserved, running, foreign, fseqs: EngineView(
        spec("e", blocks, seqs), EngineLoad(reserved, running), True, foreign, fseqs, staged
    ),
    blocks=st.integers(1, 60),
    seqs=st.integers(1, 6),
    staged=st.integers(0, 2),
    reserved=st.integers(0, 50),
    running=st.integers(0, 6),
    foreign=st.integers(0, 20),
    fseqs=st.integers(0, 3),
)
# The engine order's keys as `EngineOrder` ranks by them: higher first.
ORDER_KEY = {
    "free": lambda view, kv_ceiling: view.free_blocks(kv_ceiling),
    "running": lambda view, kv_ceiling: -view.running,
}


@pytest.mark.parametrize("name", sorted(n for n, s in SCORERS.items() if s.ordered_by))
@given(
    views=st.lists(engine, min_size=2, max_size=6),
    need=st.integers(1, 30),
    kv_ceiling=st.sampled_from((1.0, 0.9, 0.5)),
    weight=st.sampled_from((0.0, 1.0, 4.0)),
)
def test_a_scorer_ranks_engines_as_the_order_key_it_names(
    name: str, views: list[EngineView], need: int, kv_ceiling: float, weight: float
) -> None:
    """`ordered_by`'s promise, on which the stores decide grouped asks from the engine order
    (docs/engine-index.md): for one footprint with nothing cached, the scorer ranks any two
    engines as that key does, ties included. Declaring it for a scorer that ranks otherwise
    (`lowest_kv_fraction` as "free": engines of other sizes) fails here."""
    scorer = SCORERS[name]
    assert scorer.ordered_by is not None
    score, key = scorer.at_weight(weight), ORDER_KEY[scorer.ordered_by]
    footprint = Footprint(blocks=need, seqs=1, tokens=need * 16)
    for a, b in itertools.combinations(views, 2):
        by_score = score(Candidate(a, footprint), kv_ceiling) - score(
            Candidate(b, footprint), kv_ceiling
        )
        by_key = key(a, kv_ceiling) - key(b, kv_ceiling)
        assert (by_score > 0, by_score == 0) == (by_key > 0, by_key == 0), (a, b)


def test_every_key_of_the_engine_order_is_one_a_scorer_can_name() -> None:
    assert set(ORDER_KEY) == set(ORDER_KEYS)
    assert {s.ordered_by for s in SCORERS.values()} <= {*ORDER_KEYS, None}


@pytest.mark.parametrize(
    ("scorers", "ranking"),
    [
        (("most_free_after", "fewest_running"), "running"),  # the default
        (("most_free_blocks", "fewest_running"), "running"),
        (("most_free_after",), "free"),
        (("most_free_blocks",), "free"),
        (("fewest_running",), None),  # the order leads by free blocks
        (("fewest_running", "most_free_blocks"), None),
        (("most_free_after", "most_free_blocks"), None),
        (("most_free_blocks", "fewest_running", "fewest_running"), None),
        (("lowest_kv_fraction",), None),
        (("most_free_after", "lowest_kv_fraction"), None),
        (("most_free_after", "fewest_running", "lowest_kv_fraction"), None),
    ],
)
def test_the_order_ranks_as_scorers_whose_keys_are_its_first_keys(
    scorers: tuple[str, ...], ranking: str | None
) -> None:
    assert ordered_ranking(scorers) == ranking
    assert Router(scorers).ordered_by == ranking


def test_the_cached_block_weight_reaches_the_scorers_that_read_it() -> None:
    c = _prefixed("c", 50, 20, cached=4)  # 100 − 50 − 20 + 4w
    assert Router(["most_free_after"], cached_block_weight=2).score(c, 1.0) == (38.0,)
    assert SCORERS["most_free_after"].score(c, 1.0) == 30 + 4 * DEFAULT_CACHED_BLOCK_WEIGHT
    assert {n for n, s in SCORERS.items() if s.weighted} == {"most_free_after"}
