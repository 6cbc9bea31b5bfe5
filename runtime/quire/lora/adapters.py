"""EngineAdapters: what the engine holds when LoRA is on (registry, the executor's slot
manager, the scheduler's admission rule), behind the few calls the engine makes. The engine's
add_lora / remove_lora / list_loras are thin wrappers over this; the scheduler reaches it
through its LoRA feature (engine/features/lora_slots.py)."""

from __future__ import annotations

import logging

from quire.lora.admission import AdapterAdmission
from quire.lora.manager import LoRAManager, Packed
from quire.lora.registry import AdapterRegistry
from quire.lora.request import AdapterHandle, LoRARequest

logger = logging.getLogger(__name__)


class EngineAdapters:
    def __init__(self, args, manager: LoRAManager) -> None:
        """`manager`: the executor's slot manager (it holds the model's LoRA slots)."""
        self.registry = AdapterRegistry()
        self.manager = manager
        self.admission = AdapterAdmission(args.max_loras, refs=self.manager)
        for i, (name, path) in enumerate((args.lora_modules or {}).items(), start=1):
            self.add(LoRARequest(name, i, path))

    def add(self, req: LoRARequest, packed: Packed | None = None) -> bool:
        """Registers and reads the adapter (raising ValueError if it can't be served), or
        takes `packed` from manager.read(). False if this very adapter is registered
        already."""
        if not isinstance(req, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(req).__name__}")
        old = self.registry.get(req.name)
        if old is not None and old.request == req:
            return False
        handle = self.registry.new_handle(req)
        self.manager.load(handle, packed)
        self.registry.add(handle)
        return True

    def remove(self, name_or_id: str | int, running) -> bool:
        """New requests can no longer ask for it; requests already accepted (running or
        waiting) finish with it: its weights stay until the last of them ends."""
        handle = self.registry.remove(name_or_id)
        if handle is None:
            return False
        self.manager.forget(handle.key, self.admission.in_use(running))
        logger.info("removed LoRA adapter %r", handle.name)
        return True

    def resolve(self, req: LoRARequest) -> AdapterHandle:
        """The handle a request runs with; an adapter not registered yet is added (as
        LLM.generate(..., lora_request=...) expects). Its host copy is made sure of now (a
        ValueError if it is unreadable), so the request never needs its folder again."""
        self.add(req)
        handle = self.registry.get(req.name)
        if handle.key not in self.manager.host:  # (a copy there keeps its LRU place)
            self.manager.load(handle)
        return handle

    def fill_slots(self, seqs, in_use: frozenset[int]) -> dict[int, str]:
        """Before a step's forward: its adapters into slots; {key: why} for those that
        could not be brought in (the engine fails only their requests)."""
        return self.manager.fill([s.lora for s in seqs], in_use)

    def get(self, name: str) -> LoRARequest | None:
        handle = self.registry.get(name)
        return None if handle is None else handle.request

    def list(self) -> list[LoRARequest]:
        return self.registry.requests()
