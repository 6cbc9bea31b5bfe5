"""What one scheduler step hands to the worker (and back to the scheduler's update)."""

from __future__ import annotations

from dataclasses import dataclass, field

from quire.engine.request import Request


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)  # sequences run; decodes first
    num_new_tokens: list[int] = field(default_factory=list)  # per sequence in `requests`
    forks: dict[str, list[Request]] = field(default_factory=dict)  # parent id -> n>1 siblings
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) block ids
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    preempted: list[Request] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)  # per sequence in `requests`
    stuck: list[Request] = field(default_factory=list)  # failed by the liveness guard
    stuck_reason: str | None = None
    lora_keys_in_use: frozenset[int] = frozenset()  # adapters of running sequences (pinned)
    # speculative decoding: sequence id -> the proposals verified this step (its
    # num_new_tokens counts them after its one known token)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def empty(self) -> bool:
        """Nothing for the worker to do (the scheduler may still have failed stuck ones)."""
        return not self.requests and not self.swap_out and not self.swap_in
