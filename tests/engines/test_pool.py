"""EnginePool.update_spec: an engine that reports other numbers than before."""

from gateway.core.types import EngineSpec
from gateway.engines.pool import EnginePool


def pool(**spec: object) -> EnginePool:
    base = {"num_gpu_blocks": 100, "block_size": 16, "max_num_seqs": 256, "max_model_len": 512}
    return EnginePool([EngineSpec("e", "http://e", frozenset({"m"}), **(base | spec))])


def test_a_new_dp_size_rescales_the_total_max_num_seqs():
    """`max_num_seqs` is the engine's total (vLLM's per-rank flag × ranks): a restart with
    two ranks where there was one doubles it, and back halves it."""
    p = pool()
    p.update_spec("e", "discovered:/metrics", num_gpu_blocks=200, dp_size=2)
    spec = p.get("e").spec
    assert (spec.dp_size, spec.max_num_seqs, spec.rank_max_num_seqs) == (2, 512, 256)
    assert p.get("e").sources["max_num_seqs"] == "discovered:/metrics"
    p.update_spec("e", "discovered:/metrics", dp_size=1)
    assert (p.get("e").spec.max_num_seqs, p.get("e").spec.rank_max_num_seqs) == (256, 256)


def test_an_explicit_max_num_seqs_wins_over_the_rescaling():
    p = pool()
    p.update_spec("e", "config", dp_size=2, max_num_seqs=300)
    assert p.get("e").spec.max_num_seqs == 300


def test_same_numbers_change_nothing():
    p = pool(dp_size=2, max_num_seqs=512)
    p.update_spec("e", "discovered:/metrics", dp_size=2, num_gpu_blocks=100)
    assert p.get("e").spec.max_num_seqs == 512
    assert "max_num_seqs" not in p.get("e").sources


def test_a_new_process_start_time_or_a_readmission_starts_a_new_epoch():
    """The engine's cache may be empty since: what the gateway expects it to cache goes."""
    p = pool()
    p.started("e", 1000.0)
    p.started("e", 1000.0)
    p.started("e", None)  # a page without the figure says nothing
    assert p.get("e").epoch == 0
    p.started("e", 2000.0)
    assert p.get("e").epoch == 1
    p.mark_healthy("e")  # healthy already: nothing happened
    assert p.get("e").epoch == 1
    p.get("e").healthy = False
    p.mark_healthy("e")
    assert p.get("e").epoch == 2


def test_changed_views_are_those_whose_fields_were_set_or_whose_full_hold_ran_out() -> None:
    """What the scheduler gives the store before a decision (`StateStore.set_views`)."""
    from gateway.core.ledger import Foreign

    now = [100.0]
    specs = [EngineSpec(n, f"http://{n}", frozenset({"m"}), 11, 16, 4, 4096) for n in "abc"]
    pool = EnginePool(specs, clock=lambda: now[0], staged_seqs=2)
    assert [v.spec.name for v in pool.changed_views()] == ["a", "b", "c"]  # all new
    assert pool.changed_views() == []
    pool.get("b").foreign = Foreign(blocks=3, seqs=1)  # as the monitor sets it
    pool.mark_unhealthy("c", "down", retry_at=0.0)
    got = {v.spec.name: v for v in pool.changed_views()}
    assert set(got) == {"b", "c"}
    assert got["b"].foreign_blocks == 3 and got["b"].staged_seqs == 2
    assert not got["c"].healthy
    pool.refused("a", hold_s=5.0)
    assert [(v.spec.name, v.healthy) for v in pool.changed_views()] == [("a", False)]
    now[0] += 4.0
    assert pool.changed_views() == []
    now[0] += 1.0  # the hold ran out: "a" is routable again, with no field set
    assert [(v.spec.name, v.healthy) for v in pool.changed_views()] == [("a", True)]
    pool.ended("a")  # clears the hold that ran out: the view is as it was
    assert [(v.spec.name, v.healthy) for v in pool.changed_views()] in ([], [("a", True)])
    pool.ended("a")  # nothing held: nothing set
    assert pool.changed_views() == []
    pool.get("a").runs_beyond_max = True
    assert [(v.spec.name, v.staged_seqs) for v in pool.changed_views()] == [("a", 0)]
