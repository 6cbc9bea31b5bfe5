"""LoRARequest: which adapter a request runs with (vLLM's (lora_name, lora_int_id,
lora_path), under shorter names), and the handle the engine resolves it to."""

from __future__ import annotations

from dataclasses import dataclass

from quire.validation import QuireValidationError


@dataclass(frozen=True)
class LoRARequest:
    """name: what clients ask for (the OpenAI `model` field); id: a positive integer unique
    among the loaded adapters; path: a folder in PEFT's format."""

    name: str
    id: int
    path: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise QuireValidationError(
                "lora_request", f"lora_request.name must be a non-empty string, got "
                f"{self.name!r}", self.name)
        if isinstance(self.id, bool) or not isinstance(self.id, int) or self.id < 1:
            raise QuireValidationError(
                "lora_request", f"lora_request.id must be an integer >= 1, got {self.id!r}",
                self.id)
        if not isinstance(self.path, str) or not self.path:
            raise QuireValidationError(
                "lora_request", f"lora_request.path must be a non-empty string, got "
                f"{self.path!r}", self.path)


@dataclass(frozen=True)
class AdapterHandle:
    """One registration of an adapter. `key` is unique for the engine's lifetime, so an
    adapter removed and added again (perhaps with new weights at the same path) never reuses
    the old one's device slot or prefix-cache blocks."""

    key: int
    request: LoRARequest

    @property
    def name(self) -> str:
        return self.request.name
