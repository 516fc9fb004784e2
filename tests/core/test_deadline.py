"""The deadline gate (core/deadline.py): which engines meet a request's targets now."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.deadline import Eligible, Outlook, Unattainable, Wait, decide


def o(engine, ttft, step, idle=0.05, tightest=None):
    return Outlook(engine, ttft_s=ttft, step_s=step, idle_ttft_s=idle, tightest_tpot_s=tightest)


def test_only_the_engines_that_meet_both_targets():
    outlooks = [o("a", 0.4, 0.03), o("b", 1.2, 0.03), o("c", 0.2, 0.06)]
    assert decide(outlooks, ttft_s=1.0, tpot_s=0.05) == Eligible(frozenset({"a"}))


def test_what_is_left_of_the_ttft_target_counts_not_the_target():
    outlooks = [o("a", 0.4, 0.03)]
    assert decide(outlooks, ttft_s=1.0, tpot_s=None, waited_s=0.5) == Eligible(frozenset({"a"}))
    got = decide(outlooks, ttft_s=1.0, tpot_s=None, waited_s=0.7)
    # 0.3 left: 0.25 s of waiting on an idle engine; loaded as now (0.4), none
    assert got == Wait(pytest.approx(0.25), likely_s=pytest.approx(-0.1))


def test_waits_while_an_idle_engine_could_still_make_it():
    outlooks = [o("a", 2.0, 0.03, idle=0.1), o("b", 3.0, 0.03, idle=0.3)]
    got = decide(outlooks, ttft_s=1.0, tpot_s=0.05, waited_s=0.2)
    # 0.8 left, the best idle TTFT 0.1; loaded as now the best TTFT is 2.0: none to spare
    assert got == Wait(pytest.approx(0.7), likely_s=pytest.approx(-1.2))


def test_refused_at_once_when_even_an_idle_engine_is_too_slow():
    outlooks = [o("a", 2.0, 0.03, idle=1.5), o("b", 3.0, 0.03, idle=1.2)]
    got = decide(outlooks, ttft_s=1.0, tpot_s=0.05)
    assert got == Unattainable(best_ttft_s=1.2, left_s=1.0)


def test_refused_when_its_wait_has_used_up_the_target():
    got = decide([o("a", 0.5, 0.03, idle=0.1)], ttft_s=1.0, tpot_s=None, waited_s=0.95)
    assert isinstance(got, Unattainable) and got.left_s == pytest.approx(0.05)


def test_best_effort_fills_what_the_targets_leave():
    # A batch request (no targets) may go where the step time stays within the running
    # requests' tightest TPOT target, and waits (no deadline of its own) elsewhere.
    outlooks = [o("a", 5.0, 0.06, tightest=0.05), o("b", 5.0, 0.04, tightest=0.05)]
    assert decide(outlooks, ttft_s=None, tpot_s=None) == Eligible(frozenset({"b"}))
    assert decide(outlooks[:1], ttft_s=None, tpot_s=None) == Wait(math.inf)
    assert decide([o("c", 9.0, 9.0)], ttft_s=None, tpot_s=None) == Eligible(frozenset({"c"}))


def test_a_target_request_does_not_break_a_tighter_one_running():
    outlooks = [o("a", 0.1, 0.04, tightest=0.03)]
    # The TTFT would fit (0.1): only the TPOT of the running requests keeps it waiting.
    assert decide(outlooks, ttft_s=1.0, tpot_s=0.05) == Wait(
        pytest.approx(0.95), likely_s=pytest.approx(0.9)
    )


def test_no_candidates_waits_or_is_unattainable():
    assert decide([], ttft_s=None, tpot_s=None) == Wait(math.inf)
    assert isinstance(decide([], ttft_s=1.0, tpot_s=None), Unattainable)


seconds = st.floats(0.0, 5.0)


@given(
    st.lists(st.tuples(seconds, seconds, seconds, st.none() | seconds), max_size=4),
    st.none() | st.floats(0.01, 3.0),
    st.none() | st.floats(0.01, 0.2),
    st.floats(0.0, 3.0),
)
def test_eligible_engines_meet_every_target_and_the_others_do_not(rows, ttft, tpot, waited):
    outlooks = [o(f"e{i}", t, s, min(i_, t), tight) for i, (t, s, i_, tight) in enumerate(rows)]
    got = decide(outlooks, ttft_s=ttft, tpot_s=tpot, waited_s=waited)
    left = math.inf if ttft is None else ttft - waited

    def ok(x):
        return (
            x.ttft_s <= left
            and (tpot is None or x.step_s <= tpot)
            and (x.tightest_tpot_s is None or x.step_s <= x.tightest_tpot_s)
        )

    good = {x.engine for x in outlooks if ok(x)}
    if good:
        assert got == Eligible(frozenset(good))
    elif ttft is None:
        assert got == Wait(math.inf)
    else:
        best = min((x.idle_ttft_s for x in outlooks), default=math.inf)
        assert isinstance(got, Unattainable) == (best > left)
        if isinstance(got, Wait):
            assert 0 <= got.for_s <= left


def test_out_of_reach_when_the_line_ahead_outlasts_the_deadline():
    from gateway.core.deadline import out_of_reach

    wait = Wait(0.5)
    assert wait.expected_s == 0.5
    assert out_of_reach(wait, ahead=3, admitted_per_s=4.0)  # ~1 s to its turn
    assert not out_of_reach(wait, ahead=1, admitted_per_s=4.0)  # ~0.5 s: may make it
    assert not out_of_reach(wait, ahead=0, admitted_per_s=0.1)  # first in line: it waits
    assert not out_of_reach(wait, ahead=9, admitted_per_s=None)  # no rate: no guess
    assert not out_of_reach(Wait(math.inf), ahead=9, admitted_per_s=1.0)  # no deadline


def test_out_of_reach_counts_the_load_the_engines_are_under_not_an_idle_engine():
    """Under overload an engine stays loaded: a request whose turn comes in ~0.5 s has 0.8 s
    of waiting before an idle engine would be too slow, but with the TTFT the engines give
    now (0.6 s of its 0.9 s left) only 0.3 s: refused at once."""
    from gateway.core.deadline import out_of_reach

    got = decide([o("a", 0.6, 0.06, idle=0.1)], ttft_s=1.0, tpot_s=0.05, waited_s=0.1)
    assert got == Wait(pytest.approx(0.8), likely_s=pytest.approx(0.3))
    assert got.expected_s == pytest.approx(0.3)
    assert out_of_reach(got, ahead=1, admitted_per_s=4.0)  # its turn in ~0.5 s
    assert not out_of_reach(got, ahead=1, admitted_per_s=8.0)  # in ~0.25 s
    # Bounded by the idle bound: a loaded TTFT below the idle one is not a promise.
    assert Wait(0.2, likely_s=0.9).expected_s == 0.2


def test_a_forecast_turn_decides_even_first_in_line():
    """With the running requests' ends forecast, the request's turn is the (ahead + 1)-th
    of them: it is refused when that comes after what it can wait, first in line included,
    whatever the rate; without a forecast the rate rule stands."""
    from gateway.core.deadline import out_of_reach

    wait = Wait(0.8, likely_s=0.5)
    assert out_of_reach(wait, ahead=0, admitted_per_s=100.0, turn_s=0.6)
    assert not out_of_reach(wait, ahead=0, admitted_per_s=0.1, turn_s=0.4)
    assert not out_of_reach(wait, ahead=5, admitted_per_s=None, turn_s=0.4)
    assert not out_of_reach(Wait(math.inf), ahead=0, admitted_per_s=1.0, turn_s=9.0)
    assert not out_of_reach(wait, ahead=0, admitted_per_s=1.0, turn_s=None)  # the rate rule
    assert out_of_reach(wait, ahead=1, admitted_per_s=1.0, turn_s=None)  # 2 s > 0.5 s
