"""AdapterRegistry: the adapters clients can ask for, by name. Bookkeeping only."""

from __future__ import annotations

import itertools

from quire.lora.request import AdapterHandle, LoRARequest
from quire.validation import QuireValidationError


class AdapterRegistry:
    def __init__(self) -> None:
        self.by_name: dict[str, AdapterHandle] = {}
        self._keys = itertools.count(1)

    def get(self, name: str) -> AdapterHandle | None:
        return self.by_name.get(name)

    def new_handle(self, req: LoRARequest) -> AdapterHandle:
        """A handle for an adapter not registered yet; raises if it clashes with one that is."""
        old = self.by_name.get(req.name)
        if old is not None:
            raise QuireValidationError(
                "lora_request", f"a LoRA adapter named {req.name!r} is already loaded (id "
                f"{old.request.id}, path {old.request.path!r}); remove it first", req.name)
        for h in self.by_name.values():
            if h.request.id == req.id:
                raise QuireValidationError(
                    "lora_request", f"lora_request.id {req.id} is already used by adapter "
                    f"{h.name!r}", req.id)
        return AdapterHandle(next(self._keys), req)

    def add(self, handle: AdapterHandle) -> None:
        self.by_name[handle.name] = handle

    def remove(self, name_or_id: str | int) -> AdapterHandle | None:
        for name, h in self.by_name.items():
            if name_or_id == (name if isinstance(name_or_id, str) else h.request.id):
                return self.by_name.pop(name)
        return None

    def requests(self) -> list[LoRARequest]:
        return [h.request for h in self.by_name.values()]
