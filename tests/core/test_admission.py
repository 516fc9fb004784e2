"""Admission invariants, exhaustively: a pure ledger driven by the router and placement."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.admission import NeverFits, Placement, place
from gateway.core.routing import Candidate, Router
from gateway.core.types import EngineLoad, EngineSpec, EngineView, RequestShape

engines_st = st.lists(
    st.builds(
        lambda i, blocks, bs, seqs, mml: EngineSpec(
            f"e{i}", "http://x", frozenset({"m"}), blocks, bs, seqs, mml
        ),
        st.integers(0, 10**6),
        st.integers(2, 200),
        st.sampled_from([16, 32, 128]),
        st.integers(1, 16),
        st.sampled_from([256, 512, 2048]),
    ),
    min_size=1,
    max_size=4,
    unique_by=lambda s: s.name,
)
shape_st = st.builds(
    RequestShape,
    st.tuples(st.integers(0, 3000)),
    st.one_of(st.none(), st.integers(1, 3000)),
    st.integers(1, 4),
)


def test_never_fits_names_the_numbers():
    e = EngineSpec("e", "http://x", frozenset({"m"}), 11, 16, 8, 4096)
    result = place(RequestShape((100,), 1000, 1), [e], 1.0)
    assert isinstance(result, NeverFits)
    assert "69 KV blocks" in result.message and "at most 10 blocks" in result.message
    assert isinstance(place(RequestShape((100,), 60, 1), [e], 1.0), Placement)


@settings(max_examples=300, deadline=None)
@given(engines_st, st.lists(st.tuples(shape_st, st.booleans()), max_size=40), st.floats(0.1, 1.0))
def test_ledger_never_overcommits(engines, ops, ceiling):
    """Reserved blocks never exceed ceiling × usable blocks; seqs never exceed max_num_seqs;
    every lease is released exactly once; a request that fits nowhere is refused, never held."""
    router, rng = Router(), random.Random(0)
    loads = {e.name: EngineLoad() for e in engines}
    leases: list[tuple[str, int, int]] = []
    released = 0
    for shape, release_one in ops:
        if release_one and leases:
            name, blocks, seqs = leases.pop(rng.randrange(len(leases)))
            cur = loads[name]
            loads[name] = EngineLoad(cur.reserved_blocks - blocks, cur.reserved_seqs - seqs)
            released += 1
        placement = place(shape, engines, ceiling)
        if isinstance(placement, NeverFits):
            continue
        by_name = {e.name: e for e in engines}
        cands = [
            Candidate(EngineView(by_name[n], loads[n]), need) for n, need in placement.needs.items()
        ]
        chosen = router.pick(cands, ceiling, rng)
        if chosen is None:
            continue
        name = chosen.view.spec.name
        cur = loads[name]
        loads[name] = EngineLoad(
            cur.reserved_blocks + chosen.need.blocks, cur.reserved_seqs + chosen.need.seqs
        )
        leases.append((name, chosen.need.blocks, chosen.need.seqs))
        for e in engines:
            assert loads[e.name].reserved_blocks <= e.capacity_blocks(ceiling)
            assert loads[e.name].reserved_seqs <= e.max_num_seqs
    while leases:
        name, blocks, seqs = leases.pop()
        cur = loads[name]
        loads[name] = EngineLoad(cur.reserved_blocks - blocks, cur.reserved_seqs - seqs)
    assert all(load == EngineLoad() for load in loads.values())


@given(engines_st, shape_st, st.floats(0.1, 1.0))
def test_placement_only_lists_engines_where_it_fits_when_empty(engines, shape, ceiling):
    placement = place(shape, engines, ceiling)
    if isinstance(placement, Placement):
        for name, need in placement.needs.items():
            e = next(x for x in engines if x.name == name)
            assert need.blocks <= e.capacity_blocks(ceiling)
            assert need.seqs <= e.max_num_seqs
            # an empty engine always takes it
            assert Router().pick(
                [Candidate(EngineView(e, EngineLoad()), need)], ceiling, random.Random(0)
            )


def test_a_request_must_fit_one_data_parallel_rank():
    """vLLM runs a request on one DP rank: 2 ranks of 50 blocks (49 usable each) hold a
    60-block request nowhere, though the engine has 98 usable blocks in all."""
    dp = EngineSpec("dp", "http://x", frozenset({"m"}), 100, 16, 8, 4096, dp_size=2)
    assert dp.capacity_blocks(1.0) == 98 and dp.rank_capacity_blocks(1.0) == 49
    too_big = place(RequestShape((16,), 944, 1), [dp], 1.0)  # 60 blocks
    assert isinstance(too_big, NeverFits)
    assert "at most 49 blocks" in too_big.message and "2 data-parallel ranks" in too_big.message
    fits = place(RequestShape((16,), 768, 1), [dp], 1.0)  # 49 blocks
    assert isinstance(fits, Placement) and fits.needs["dp"].blocks == 49
    # Sequences too: max_num_seqs is the engine's total over its ranks (8 = 4 per rank).
    many = place(RequestShape((16,), 16, 5), [dp], 1.0)
    assert isinstance(many, NeverFits) and "max_num_seqs=4 per data-parallel rank" in many.message
    assert isinstance(place(RequestShape((16,), 16, 4), [dp], 1.0), Placement)


@given(engines_st, st.floats(0.1, 1.0))
def test_without_data_parallelism_a_rank_is_the_engine(engines, ceiling):
    for e in engines:
        assert e.rank_capacity_blocks(ceiling) == e.capacity_blocks(ceiling)
        assert e.rank_max_num_seqs == e.max_num_seqs
