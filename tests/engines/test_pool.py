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
