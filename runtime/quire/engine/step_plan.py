"""The scheduler's working plan for one step, with its sequences: what the features see in
`after_schedule` and what becomes the plain SchedulerOutput. It never leaves the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from quire.engine.request import Request


@dataclass
class StepPlan:
    requests: list[Request] = field(default_factory=list)  # sequences run; decodes first
    num_new_tokens: list[int] = field(default_factory=list)  # per sequence in `requests`
    forks: dict[str, list[Request]] = field(default_factory=dict)  # parent id -> n>1 siblings
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) block ids
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    preempted: list[Request] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)  # per sequence in `requests`
    # (client request id, why) of requests that fail this step: the liveness guard, a grammar
    # that did not compile, an adapter that got no slot
    failed: list[tuple[str, str]] = field(default_factory=list)
    lora_keys_in_use: frozenset[int] = frozenset()  # adapters of running sequences (pinned)
    # speculative decoding: sequence id -> the proposals verified this step (its
    # num_new_tokens counts them after its one known token)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    def drop(self, gone: set[str]) -> None:
        """These sequences leave the step before its forward."""
        keep = [i for i, s in enumerate(self.requests) if s.request_id not in gone]
        self.requests = [self.requests[i] for i in keep]
        self.num_new_tokens = [self.num_new_tokens[i] for i in keep]
        self.block_tables = [self.block_tables[i] for i in keep]
        for rid in gone:
            self.forks.pop(rid, None)
            self.spec_token_ids.pop(rid, None)
