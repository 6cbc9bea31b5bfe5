"""What the metrics show of LoRA: the adapters loaded, and which of them running and waiting
sequences use (per adapter name)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAStats:
    max_loras: int
    loaded: tuple[str, ...]      # registered adapter names
    running: dict[str, int]      # adapter name -> running sequences
    waiting: dict[str, int]      # adapter name -> waiting (or swapped-out) sequences


def lora_stats(adapters, scheduler) -> LoRAStats:
    """adapters: the engine's EngineAdapters; scheduler: its Scheduler (read only)."""
    def count(seqs) -> dict[str, int]:
        c: Counter[str] = Counter()
        for s in seqs:
            if s.lora is not None:  # a waiting request counts its n samples (num_seqs)
                c[s.lora.name] += getattr(s, "num_seqs", 1)
        return dict(c)

    return LoRAStats(max_loras=adapters.manager.max_loras,
                     loaded=tuple(adapters.registry.by_name),
                     running=count(scheduler.running),
                     waiting=count([*scheduler.waiting, *scheduler.swapped]))
