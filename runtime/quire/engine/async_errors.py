"""The exceptions the async engine raises, each with one HTTP meaning in
`entrypoints/errors.py`. Import them from `quire.engine.async_engine` (the public interface);
they live here so the lifecycle and the commands can raise them without an import cycle."""

from __future__ import annotations


class EngineNotReady(RuntimeError):
    """The model is still loading."""


class EngineOverloaded(RuntimeError):
    """The waiting queue is at --max-queue-len."""


class EngineShuttingDown(RuntimeError):
    """The server is draining and admits no new requests."""


class EngineDeadError(RuntimeError):
    """The engine loop (or the model load) failed; nothing more will be served."""


class RequestFailed(RuntimeError):
    """This request failed on its own (RequestOutput.error); others go on."""


class AdapterNotFound(LookupError):
    """The LoRA adapter a request or an unload names is not loaded."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class AdapterExists(ValueError):
    """A load names an adapter that is loaded (or being loaded) already."""
