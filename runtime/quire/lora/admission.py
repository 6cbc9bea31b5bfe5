"""The scheduler's LoRA rule: the running requests use at most `max_loras` distinct adapters,
so that each of them holds a device slot for as long as it runs (none is ever evicted under a
running request). A waiting request whose adapter would be one too many waits; requests
behind it, for the base model or an adapter already running, may go first.

It also counts, for the manager, the sequences that hold each adapter: from the moment the
scheduler accepts them (`hold`) until they finish or abort (`release`)."""

from __future__ import annotations


def adapter_key(request) -> int | None:
    return None if request.lora is None else request.lora.key


class AdapterAdmission:
    def __init__(self, max_loras: int, refs=None) -> None:
        """refs: what keeps the adapters' host copies (LoRAManager.hold / release)."""
        self.max_loras = max_loras
        self.refs = refs
        self._active: set[int] = set()

    def hold(self, request) -> None:
        """A new request: it and its pending siblings hold its adapter."""
        key = adapter_key(request)
        if key is not None and self.refs is not None:
            self.refs.hold(key, request.num_seqs)

    def release(self, ended) -> None:
        """These sequences ended (a finished one with its never-forked siblings)."""
        for seq in ended:
            key = adapter_key(seq)
            if key is not None and self.refs is not None:
                self.refs.release(key)

    def start_step(self, running) -> None:
        self._active = {k for k in map(adapter_key, running) if k is not None}

    def try_admit(self, request) -> bool:
        key = adapter_key(request)
        if key is None or key in self._active:
            return True
        if len(self._active) >= self.max_loras:
            return False
        self._active.add(key)
        return True

    @staticmethod
    def in_use(running) -> frozenset[int]:
        """The adapters whose slots the step's mapping must not take away."""
        return frozenset(k for k in map(adapter_key, running) if k is not None)
