"""The foreign-load estimate: what an engine reports beyond the gateway's own ledger."""

from hypothesis import given
from hypothesis import strategies as st

from gateway.core.ledger import Foreign, Reported, foreign_load, own_during
from gateway.core.types import EngineLoad


def test_no_foreign_sequence_means_no_foreign_block() -> None:
    # The gateway's 3 requests hold 40 of their 60 reserved blocks (its estimate from their
    # prompts: 12): no foreign sequence, so none of the difference is foreign.
    own = EngineLoad(reserved_blocks=60, reserved_seqs=3, prompt_blocks=12)
    assert foreign_load(Reported(running=3, waiting=0, used_blocks=40), own) == Foreign(0, 0)


def test_own_requests_outgrowing_their_reservations_are_counted() -> None:
    # `predicted`: the gateway's 3 requests were reserved 30 blocks and hold 38.
    own = EngineLoad(reserved_blocks=30, reserved_seqs=3, prompt_blocks=12)
    assert foreign_load(Reported(running=3, waiting=0, used_blocks=38), own) == Foreign(0, 8)


def test_a_direct_client_is_seen_in_sequences_and_blocks() -> None:
    own = EngineLoad(reserved_blocks=60, reserved_seqs=3, prompt_blocks=12)
    got = foreign_load(Reported(running=4, waiting=1, used_blocks=40), own)
    assert got == Foreign(seqs=2, blocks=28)  # 40 used − 12 of the gateway's prompts


def test_fewer_reported_than_own_is_not_negative() -> None:
    # Requests the gateway admitted but the engine has not seen yet.
    own = EngineLoad(reserved_blocks=60, reserved_seqs=5, prompt_blocks=30)
    assert foreign_load(Reported(running=2, waiting=0, used_blocks=10), own) == Foreign(0, 0)


def test_missing_figures_give_no_estimate_of_their_kind() -> None:
    own = EngineLoad(reserved_blocks=10, reserved_seqs=1, prompt_blocks=2)
    assert foreign_load(Reported(), own) == Foreign(0, 0)
    assert not Reported(running=1, waiting=0).complete
    # Without sequence counts, blocks beyond the own prompts are foreign.
    assert foreign_load(Reported(used_blocks=9), own) == Foreign(0, 7)
    # Without blocks, sequences still count.
    assert foreign_load(Reported(running=3, waiting=0), own) == Foreign(2, 0)
    assert foreign_load(Reported(running=1, waiting=0, used_blocks=12), own) == Foreign(0, 2)


def test_own_during_a_scrape_is_the_smaller_of_before_and_after() -> None:
    before = EngineLoad(reserved_blocks=10, reserved_seqs=4, prompt_blocks=5)
    after = EngineLoad(reserved_blocks=20, reserved_seqs=2, prompt_blocks=7)
    assert own_during(before, after) == EngineLoad(10, 2, 5)


loads = st.builds(
    EngineLoad,
    st.integers(0, 1000),
    st.integers(0, 100),
    st.integers(0, 1000),
)


@given(
    own=loads,
    foreign_seqs=st.integers(0, 50),
    foreign_blocks=st.integers(0, 500),
    own_actual=st.integers(0, 1000),
)
def test_a_true_foreign_load_is_never_underestimated_when_own_use_covers_the_prompts(
    own: EngineLoad, foreign_seqs: int, foreign_blocks: int, own_actual: int
) -> None:
    # The engine reports exactly the gateway's requests plus a foreign load. Whenever the
    # gateway's requests hold at least their prompts (running), the estimate is at least the
    # truth: the gateway admits less than it could, never more.
    actual = max(own_actual, own.prompt_blocks)
    reported = Reported(
        running=own.reserved_seqs + foreign_seqs, waiting=0, used_blocks=actual + foreign_blocks
    )
    got = foreign_load(reported, own)
    assert got.seqs == foreign_seqs
    if foreign_seqs:
        assert got.blocks >= foreign_blocks
