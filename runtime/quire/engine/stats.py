"""What the engine reports for metrics: a snapshot of its state, and per-step events."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineSnapshot:
    num_running: int
    num_waiting: int
    num_swapped: int
    blocks_total: int
    blocks_used: int
    blocks_cached_free: int      # free, but holding a reusable prefix
    kv_usage: float              # blocks_used / blocks_total
    slack_tokens: int            # allocated slots not yet filled
    host_blocks_total: int
    host_blocks_used: int
    preemptions: dict[str, int]  # by kind: recompute, swap
    prefix_queries: int          # prompt tokens looked up in the prefix cache
    prefix_hits: int             # ... found there
    lora: object | None = None   # quire.lora.stats.LoRAStats when LoRA is on (async engine)
    # sequences per priority band (sched_policy.counts_by_band), for the queue metrics
    waiting_by_priority: dict[str, int] = field(default_factory=dict)
    running_by_priority: dict[str, int] = field(default_factory=dict)
    kv_tiers: dict | None = None  # tier -> lifetime counters (kv_tiers TierChain.snapshot)
    # a multimodal model's encoder cache: lifetime lookups found / not found (None: no images)
    encoder_cache: dict[str, int] | None = None


@dataclass
class StepEvents:
    """Accumulated between two drains; the metrics endpoint turns them into counters and
    histogram observations."""
    prompt_tokens: int = 0           # prompt tokens the model computed
    generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    e2e_latency: list[float] = field(default_factory=list)
    queue_time: list[float] = field(default_factory=list)
    finished_reasons: list[str] = field(default_factory=list)
    structured_requests: int = 0     # requests added with a grammar (guided decoding)
    grammar_mask_time: list[float] = field(default_factory=list)  # s filling masks, per step
    # speculative decoding: sequences that verified proposals, the proposals, the accepted
    # ones, and accepted ones per position (index 0: the first proposal)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
