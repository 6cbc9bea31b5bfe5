"""The async engine's lifecycle table: exactly these transitions are legal, every other one is
refused with an error naming both states, and each state refuses what it should."""

from __future__ import annotations

import itertools

import pytest

from quire.engine.async_engine import EngineDeadError, EngineNotReady, EngineShuttingDown
from quire.engine.lifecycle import EngineState as S
from quire.engine.lifecycle import (
    IllegalTransition,
    Lifecycle,
    check_transition,
)

LEGAL = {
    (S.LOADING, S.READY), (S.LOADING, S.DRAINING), (S.LOADING, S.DEAD),
    (S.READY, S.DRAINING), (S.READY, S.DEAD),
    (S.DRAINING, S.STOPPED), (S.DRAINING, S.DEAD),
}
ALL_PAIRS = list(itertools.product(S, S))
# a legal way from LOADING into each state
PATH = {S.LOADING: [], S.READY: [S.READY], S.DRAINING: [S.DRAINING],
        S.STOPPED: [S.DRAINING, S.STOPPED], S.DEAD: [S.DEAD]}


def lifecycle_in(state: S) -> Lifecycle:
    lifecycle = Lifecycle()
    for step in PATH[state]:
        lifecycle.move_to(step, "boom" if step is S.DEAD else None)
    assert lifecycle.state is state
    return lifecycle


@pytest.mark.parametrize("current,new", sorted(LEGAL, key=str))
def test_legal_transitions_are_taken(current, new):
    lifecycle = lifecycle_in(current)
    assert lifecycle.can_move_to(new)
    lifecycle.move_to(new, "boom" if new is S.DEAD else None)
    assert lifecycle.state is new
    assert lifecycle.fatal_error == ("boom" if new is S.DEAD else None)


@pytest.mark.parametrize("current,new", [p for p in ALL_PAIRS if p not in LEGAL], ids=str)
def test_illegal_transitions_are_refused_naming_both_states(current, new):
    with pytest.raises(IllegalTransition, match=f"from {current.name} to {new.name}"):
        check_transition(current, new)
    lifecycle = lifecycle_in(current)
    assert not lifecycle.can_move_to(new)
    with pytest.raises(IllegalTransition, match=f"from {current.name} to {new.name}"):
        lifecycle.move_to(new, "boom" if new is S.DEAD else None)
    assert lifecycle.state is current  # a refused move changes nothing


def test_stopped_and_dead_are_final():
    for final in (S.STOPPED, S.DEAD):
        assert not any(lifecycle_in(final).can_move_to(s) for s in S)


def test_dead_carries_its_reason_and_only_dead_does():
    with pytest.raises(ValueError, match="fatal_error"):
        Lifecycle().move_to(S.DEAD)
    with pytest.raises(ValueError, match="fatal_error"):
        Lifecycle().move_to(S.READY, "why")
    assert Lifecycle().state is S.LOADING


def test_leaving_loading_wakes_the_waiters():
    lifecycle = Lifecycle()
    assert not lifecycle.left_loading.is_set()
    lifecycle.move_to(S.DRAINING)  # a drain while the model loads ends the wait too
    assert lifecycle.left_loading.is_set()


@pytest.mark.parametrize("state,request_error,call_error", [
    (S.LOADING, EngineNotReady, EngineNotReady),
    (S.READY, None, None),
    (S.DRAINING, EngineShuttingDown, EngineShuttingDown),
    (S.STOPPED, EngineShuttingDown, EngineShuttingDown),
    (S.DEAD, EngineDeadError, EngineDeadError),
])
def test_what_each_state_refuses(state, request_error, call_error):
    lifecycle = lifecycle_in(state)
    for refusal, expected in ((lifecycle.request_refusal(), request_error),
                              (lifecycle.call_refusal(), call_error)):
        if expected is None:
            assert refusal is None
        else:
            assert type(refusal) is expected
        if expected is EngineDeadError:
            assert str(refusal) == "boom"  # the reason reaches the client
