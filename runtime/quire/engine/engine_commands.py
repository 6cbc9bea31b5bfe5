"""What coroutines ask of the engine thread: one FIFO queue of small commands that the loop
drains between two steps, so an add and a later abort of one request reach the engine in that
order, and so do adds, aborts and LoRA calls among themselves.

Each command runs in the engine's worker thread (`run`), keeps its outcome, and is settled on
the event loop afterwards (`settle`), or failed unrun (`fail`) when the engine dies or stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from quire.engine.async_errors import AdapterNotFound, RequestFailed
from quire.lora.request import LoRARequest
from quire.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class Command:
    """Base: run in the worker thread; settle or fail on the event loop."""

    def run(self, engine) -> None:
        """In the worker thread, between steps. An exception that escapes is fatal."""

    def settle(self) -> None:
        """On the loop, after `run`: hand the outcome to whoever waits for it."""

    def fail(self, error: BaseException) -> None:
        """On the loop, instead of running: the engine died or stopped first."""


@dataclass
class AddRequest(Command):
    request_id: str
    prompt: object
    params: SamplingParams
    arrival_time: float
    lora_request: LoRARequest | None
    future: asyncio.Future
    cache_salt: str | None = None   # keeps its KV blocks apart from other salts' (tenants)
    priority: int = 0               # lower first under --scheduling-policy priority
    error: Exception | None = None  # why the engine refused it (after run)

    def run(self, engine) -> None:
        salt = {} if self.cache_salt is None else {"cache_salt": self.cache_salt}
        if self.priority:  # (passed only when set: engines that predate it still work)
            salt["priority"] = self.priority
        try:
            if self.lora_request is None:
                engine.add_request(self.request_id, self.prompt, self.params, self.arrival_time,
                                   **salt)
            elif engine.get_lora(self.lora_request.name) != self.lora_request:
                raise AdapterNotFound(self.lora_request.name)  # unloaded since it was picked
            else:
                engine.add_request(self.request_id, self.prompt, self.params,
                                   self.arrival_time, lora_request=self.lora_request, **salt)
        except (ValueError, AdapterNotFound) as e:
            self.error = e
        except Exception as e:  # noqa: BLE001 - one odd request must not stop the loop
            logger.exception("adding request %s failed", self.request_id)
            self.error = RequestFailed(f"could not add the request: {e}")

    def settle(self) -> None:
        if self.error is None:
            _resolve(self.future, None)
        else:
            self.fail(self.error)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():  # done: the caller went away (its abort is queued)
            self.future.set_exception(error)


@dataclass
class AbortRequest(Command):
    request_id: str

    def run(self, engine) -> None:
        engine.abort_request([self.request_id])


@dataclass
class EngineCall(Command):
    """fn(*args) on the engine thread (LoRA registration); its result or error goes to the
    caller, and `then(ok)` runs on the loop once it ran or failed, even if the caller has
    stopped waiting (so a mirror kept on the loop follows the engine)."""
    fn: Callable
    args: tuple
    future: asyncio.Future
    then: Callable[[bool], None] | None = None
    result: object = None
    error: Exception | None = None

    def run(self, engine) -> None:
        try:
            self.result = self.fn(*self.args)
        except Exception as e:  # noqa: BLE001 - the caller gets it; the loop goes on
            self.error = e

    def settle(self) -> None:
        if self.error is None:
            if self.then is not None:
                self.then(True)
            _resolve(self.future, self.result)
        else:
            self.fail(self.error)

    def fail(self, error: BaseException) -> None:
        if self.then is not None:
            self.then(False)
        if not self.future.done():
            self.future.set_exception(error)


@dataclass
class Shutdown(Command):
    """The loop ends once the engine has no unfinished request and no command is queued."""


class CommandQueue:
    """FIFO of commands, with a wake-up for the loop when one arrives."""

    def __init__(self) -> None:
        self._commands: deque[Command] = deque()
        self._arrived = asyncio.Event()

    def put(self, command: Command) -> None:
        self._commands.append(command)
        self._arrived.set()

    def take_all(self) -> list[Command]:
        commands = list(self._commands)
        self._commands.clear()
        return commands

    def count(self, kind: type[Command]) -> int:
        return sum(isinstance(c, kind) for c in self._commands)

    def __len__(self) -> int:
        return len(self._commands)

    async def wait(self, timeout: float | None = None) -> None:
        """Until a command is queued (at once if one is), or `timeout` seconds passed."""
        if self._commands:
            return
        self._arrived.clear()
        try:
            await asyncio.wait_for(self._arrived.wait(), timeout)
        except asyncio.TimeoutError:
            pass


def _resolve(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)
