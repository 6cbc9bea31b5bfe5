"""The async engine's lifecycle: one state, the transitions it may take, and what each state
admits. Every reader (/health, /ready, add_request, LoRA calls, drain, shutdown) asks it.

    LOADING ──► READY ──► DRAINING ──► STOPPED
    LOADING ──► DRAINING                  (a drain or a shutdown while the model loads)
    LOADING, READY or DRAINING ──► DEAD   (the load or the loop failed)

DRAINING is entered by a drain (SIGTERM) or a shutdown, also while the model still loads:
admitted requests finish, nothing new is admitted. STOPPED and DEAD are final; DEAD carries
the reason (`fatal_error`).
"""

from __future__ import annotations

import asyncio
import enum
import logging

from quire.engine.async_errors import EngineDeadError, EngineNotReady, EngineShuttingDown

logger = logging.getLogger(__name__)


class EngineState(enum.Enum):
    LOADING = "loading"    # the model is loading; nothing is admitted yet
    READY = "ready"        # the loop runs and admits requests
    DRAINING = "draining"  # admitted requests finish; new requests and LoRA calls are refused
    STOPPED = "stopped"    # shut down: the loop has ended
    DEAD = "dead"          # the load or the loop failed; nothing more is served


LOADING, READY, DRAINING, STOPPED, DEAD = EngineState

TRANSITIONS: dict[EngineState, frozenset[EngineState]] = {
    LOADING: frozenset({READY, DRAINING, DEAD}),
    READY: frozenset({DRAINING, DEAD}),
    DRAINING: frozenset({STOPPED, DEAD}),
    STOPPED: frozenset(),
    DEAD: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A move the table does not allow: a bug in the engine, never the client's doing."""


def check_transition(current: EngineState, new: EngineState) -> None:
    """Raise IllegalTransition unless TRANSITIONS allows current -> new."""
    if new not in TRANSITIONS[current]:
        allowed = ", ".join(s.name for s in EngineState if s in TRANSITIONS[current])
        raise IllegalTransition(f"the engine cannot go from {current.name} to {new.name} "
                                f"(from {current.name}: {allowed or 'none, it is final'})")


class Lifecycle:
    """The state of one async engine. Used on the event loop only."""

    def __init__(self) -> None:
        self._state = LOADING
        self.fatal_error: str | None = None  # why it is DEAD
        self.left_loading = asyncio.Event()  # set once the state is no longer LOADING

    @property
    def state(self) -> EngineState:
        return self._state

    def can_move_to(self, new: EngineState) -> bool:
        return new in TRANSITIONS[self._state]

    def move_to(self, new: EngineState, fatal_error: str | None = None) -> None:
        """Take one transition of the table; DEAD needs its reason, no other state has one."""
        check_transition(self._state, new)
        if (new is DEAD) != (fatal_error is not None):
            raise ValueError(f"fatal_error is given with DEAD and only then, got "
                             f"{fatal_error!r} for {new.name}")
        logger.debug("engine state: %s -> %s", self._state.name, new.name)
        self._state = new
        self.fatal_error = fatal_error
        self.left_loading.set()

    def request_refusal(self) -> Exception | None:
        """The error a new request gets in this state; None where it is admitted."""
        if self._state is DRAINING or self._state is STOPPED:
            return EngineShuttingDown("the server is shutting down and admits no new requests")
        return self.call_refusal()

    def call_refusal(self) -> Exception | None:
        """The error an engine call (a LoRA load or unload) gets; None where it may run."""
        if self._state is READY:
            return None
        if self._state is LOADING:
            return EngineNotReady("the model is still loading")
        if self._state is DEAD:
            return EngineDeadError(self.fatal_error)
        return EngineShuttingDown("the server is shutting down")
