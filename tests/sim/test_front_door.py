"""The front-door decision, as vLLM's ``AsyncLLM.check_admission`` makes it."""

from __future__ import annotations

import pytest

from gateway.sim.front_door import QueueLimits

# (reqs limit, tokens limit, unfinished, sequences, backlog, expected refusal)
CASES = [
    (None, None, 999, 5, 10**6, None),
    (10, None, 5, 1, 0, None),
    (10, None, 9, 1, 0, None),
    (10, None, 10, 1, 0, "max_num_queued_reqs"),  # at the limit: refused
    (10, None, 8, 3, 0, "max_num_queued_reqs"),  # n counts: 8 + 3 > 10
    (10, None, 7, 3, 0, None),  # 7 + 3 = 10 fits
    (0, None, 0, 1, 0, "max_num_queued_reqs"),  # 0 refuses everything
    (None, 1000, 0, 1, 500, None),
    (None, 1000, 0, 1, 999, None),  # the new prompt's size does not matter
    (None, 1000, 0, 1, 1000, "max_num_queued_tokens"),  # reaching the limit refuses
    (None, 0, 0, 1, 0, "max_num_queued_tokens"),
    (100, 1000, 5, 1, 1000, "max_num_queued_tokens"),
    (10, 1000, 10, 1, 1000, "max_num_queued_reqs"),  # the request limit is checked first
]


@pytest.mark.parametrize(("reqs", "tokens", "unfinished", "sequences", "backlog", "want"), CASES)
def test_refusals(
    reqs: int | None,
    tokens: int | None,
    unfinished: int,
    sequences: int,
    backlog: int,
    want: str | None,
) -> None:
    limits = QueueLimits(reqs, tokens)
    got = limits.refusal(unfinished=unfinished, sequences=sequences, prefill_backlog_tokens=backlog)
    assert got == want


def test_negative_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="max_num_queued_tokens must be >= 0"):
        QueueLimits(max_num_queued_tokens=-1)
