import random

import pytest

from gateway.core.routing import Candidate, Router, fits
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
