"""What the model runner gets for one step: KV block moves, each scheduled sequence's chunk
(its tokens, where they start, its block table and adapter) and the rows to sample.

The engine builds it from its scheduler output (engine/batch_builder.py); the worker turns it
into one flat, unpadded batch. Neutral ground: both sides import it, it imports neither, so
the worker never sees a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from quire.sampling_batch import SamplingBatch

if TYPE_CHECKING:
    from quire.lora.request import AdapterHandle


@dataclass
class PromptLogprobsAsk:
    """A prompt chunk's ask for prompt logprobs: position start + j predicts target_ids[j]."""
    key: str               # whose they are (the engine's sequence id), handed back untouched
    num_top: int           # top entries per position (the target's own comes besides)
    target_ids: list[int]  # the prompt tokens its first len(target_ids) positions predict


@dataclass
class PromptLogprobsResult:
    """Per position of an ask: the target's logprob and rank (1 = the most likely), and the
    top ids and logprobs, most likely first."""
    key: str
    start: int             # the chunk's first position: its row j predicts token start + j + 1
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class SequenceChunk:
    """One sequence's part of a step."""
    token_ids: list[int]   # the tokens computed this step
    start: int             # tokens already in its KV blocks: the first one's position
    num_prompt_tokens: int
    num_tokens: int        # all it knows, prompt and outputs (LongRoPE picks its table by it)
    block_table: list[int]
    # rows sampled from its last token (logits rows, in chunk order): 0 while the chunk ends
    # inside what it knows (a prompt chunk), else 1 plus the n > 1 siblings forked from it
    num_samples: int
    lora: AdapterHandle | None = None  # the adapter it computes with; None: the base model
    # speculative decoding: its last num_verified tokens are proposals; every position from
    # its known token on gives a logits row (1 + num_verified rows, num_samples is 0)
    num_verified: int = 0
    prompt_logprobs: PromptLogprobsAsk | None = None  # logits of its prompt positions, scored
    # the pooling runner: its last position's final hidden state comes back under this key
    pool_key: str | None = None
    # the images (quire.multimodal.inputs.ImageSpan: hash and placeholder run) whose
    # placeholders lie in this chunk: their embeddings replace those tokens' (plain data; the
    # executor has the pixels and the encoder cache, by hash)
    images: list = field(default_factory=list)
    # M-RoPE (Qwen2.5-VL): its sequence's position triples (quire.multimodal.mrope.
    # MRopePositions, plain data shared with its Request); None: positions are 0..n-1
    mrope: object = None


@dataclass
class TierStore:
    """A block to copy out to the KV tiers after the step's forward has filled it (plain
    data: the worker reads the block's bytes, the tier chain files them by hash; the rest
    is what a KV-cache event says of the block)."""
    block_id: int
    block_hash: bytes
    parent_hash: bytes | None   # the previous block's hash in its chain (None: the first)
    token_ids: list[int]
    lora_id: int | None
    shared: bool                # may go to the tiers other processes read (disk, remote)


@dataclass
class StepBatch:
    swap_out: list[tuple[int, int]]      # (device, host) block ids
    swap_in: list[tuple[int, int]]       # (host, device)
    block_copies: list[tuple[int, int]]  # copy-on-write (source, destination)
    chunks: list[SequenceChunk]          # decodes (one token) first: backends batch them
    sampling: SamplingBatch              # one row per sample of the chunks, in their order
    lora_keys_in_use: frozenset[int] = field(default_factory=frozenset)  # pinned adapters
    # KV tiers: (block id, payload) to write into the pool before the forward (prefix hits
    # found in a tier), and blocks to copy out after it (blocks that filled this step)
    kv_load: list[tuple[int, bytes]] = field(default_factory=list)
    kv_store: list[TierStore] = field(default_factory=list)
