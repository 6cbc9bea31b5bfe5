"""Turns a step's batch description (a StepBatch, built by the engine) into one flat,
unpadded batch, runs the model, samples.

The only part of the engine that touches tensors. Host-side preparation is vectorized with
numpy: a Python loop per sequence, never per token. It never sees a request: what it needs
of one comes in the StepBatch's chunks and SamplingBatch (quire/step_batch.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from quire.attention.base import AttentionMetadata
from quire.distributed.pipeline import split_micro_batches, wait_all
from quire.multimodal.image_attention import key_limits
from quire.step_batch import PromptLogprobsResult, SequenceChunk, StepBatch
from quire.worker.kv_cache import KVCache
from quire.worker.multimodal_runner import MultiModalRunner
from quire.worker.prompt_logprobs import score_prompt_positions
from quire.worker.sampler import Sampler, SamplerOutput


@dataclass
class StepResult:
    # per sampling row (the StepBatch's SamplingBatch order): the new token, and None or
    # (sampled logprob, sampled rank, top ids, top logprobs)
    token_ids: list[int]
    logprobs: list[tuple | None]
    num_prompt_tokens: int                  # tokens computed this step that lie in a prompt
    num_tokens: int                         # all tokens computed this step
    # the chunks that asked for prompt logprobs (SequenceChunk.prompt_logprobs)
    prompt_logprobs: list[PromptLogprobsResult] = field(default_factory=list)
    # the pooling runner: pool key -> the last position's final hidden state (float32, CPU)
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class HostBatch:
    """One step's batch on the host, as numpy arrays: what the engine process sends to the
    tensor-parallel workers (picklable: no sampling state), and what every rank turns into
    device tensors the same way."""
    input_ids: np.ndarray        # [T] int64
    positions: np.ndarray        # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int64
    seq_lens: np.ndarray         # [B] int64
    block_tables: np.ndarray     # [B, max_blocks] int32
    slot_mapping: np.ndarray     # [T] int64
    num_decodes: int
    rope_seq_lens: np.ndarray | None
    # [rows that sample, then prompt positions scored, then pooled positions] int64
    logits_indices: np.ndarray
    num_prompt_tokens: int
    num_sample_rows: int = -1    # -1: every row of logits_indices samples
    num_pooled_rows: int = 0     # the last rows: pooled (final hidden states, not logits)
    # image placeholders: their rows [K] and the embeddings that replace theirs [K, hidden]
    mm_rows: np.ndarray | None = None
    mm_embeds: torch.Tensor | None = None
    # [T] int64: each token's last visible key position, where an image's run looks ahead
    # (a family with bidirectional image attention); None: causal (AttentionMetadata's)
    key_limits: np.ndarray | None = None
    # the rotary's positions where they are not `positions` (which place the KV slots):
    # M-RoPE's [3, T] triples, or [T] shifted by each sequence's delta (past its prompt)
    rope_positions: np.ndarray | None = None


@dataclass
class StepInputs:
    """Everything a rank needs for one step: KV block moves, then the batch (if any)."""
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    block_copies: list[tuple[int, int]]
    batch: HostBatch | None
    kv_load: list[tuple[int, bytes]] = field(default_factory=list)  # KV tiers: before
    kv_store: list = field(default_factory=list)                    # ... and after the forward
    # pipeline parallelism: the batch as micro-batches, in order (batch is None then)
    micro_batches: list[HostBatch] = field(default_factory=list)


@dataclass
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    rope_seq_lens: torch.Tensor | None
    logits_indices: torch.Tensor
    num_prompt_tokens: int


class ModelRunner:
    """On rank 0 (the engine process) `execute` prepares the step, sends it to the
    tensor-parallel workers (if any), runs this rank's shard and samples; a worker runs
    `run` on what it received."""

    def __init__(self, model, kv_cache: KVCache, sampler: Sampler | None, block_size: int,
                 device: torch.device, host_cache: KVCache | None = None,
                 workers=None, lora=None, cuda_graphs: bool = False,
                 max_num_seqs: int = 256, pipeline=None) -> None:
        self.model = model
        # pipeline parallelism (quire.distributed.pipeline): this stage's links, and how many
        # micro-batches a step's batch is cut into (one per stage, as vLLM's virtual engines)
        self.pipeline = pipeline
        self.micro_batches = pipeline.num_stages if pipeline is not None else 1
        self.lora = lora  # a quire.lora LoRAManager, when LoRA is on
        self.kv_cache = kv_cache
        self.host_cache = host_cache  # swap space
        self.sampler = sampler
        self.block_size = block_size
        self.device = device
        self.dynamic_rope = model.rope.needs_seq_lens  # dynamic NTK, LongRoPE
        self.mrope = getattr(model.rope, "mrope_section", None) is not None  # Qwen2.5-VL
        self.long_rope = model.rope.long_threshold is not None
        self.workers = workers  # quire.distributed.workers.Workers, at tensor-parallel size > 1
        # a family that takes images: their pixels, the encoder runs and its cache
        self.mm = (MultiModalRunner(model, device)
                   if getattr(model, "encode_images", None) is not None else None)
        # Gemma 3: each image's run attends both ways (the scheduler keeps a run in one chunk)
        self.mm_bidirectional = self.mm is not None and getattr(model, "mm_bidirectional",
                                                                 False)
        self.cuda_graphs = None  # decode steps replay CUDA graphs: one GPU, no LoRA
        graph_safe = all(b.supports_cuda_graphs for b in model.backends.values())
        if (cuda_graphs and device.type == "cuda" and workers is None and lora is None
                and pipeline is None and not self.dynamic_rope and graph_safe):
            from quire.worker.cuda_graphs import CUDAGraphRunner
            self.cuda_graphs = CUDAGraphRunner(model, kv_cache.layers, max_num_seqs,
                                               model.rope.cos_table.shape[0], block_size, device)
            self.cuda_graphs.capture_all()
        self.decode_stack = None  # decode steps' layers in one native call (CPU, quantized)
        if device.type == "cpu" and workers is None and lora is None and pipeline is None:
            from quire.models.llama import DecoderLayer
            from quire.native.decode_stack import DecodeStack
            self.decode_stack = DecodeStack.build(model, kv_cache.layers, DecoderLayer)
        if workers is not None:  # they allocate the same blocks for their KV heads
            workers.allocate_kv_cache(kv_cache.num_blocks,
                                      host_cache.num_blocks if host_cache else 0)

    @torch.inference_mode()
    def execute(self, step: StepBatch) -> StepResult:
        batch, micro = None, []
        if step.chunks and self.pipeline is not None:
            chunks = _verification_as_decodes(step.chunks)
            micro = [self._prepare(step, part)
                     for part in split_micro_batches(chunks, self.micro_batches)]
        elif step.chunks:
            batch = self._prepare(step)
        inputs = StepInputs(step.swap_out, step.swap_in, step.block_copies, batch,
                            step.kv_load, step.kv_store, micro)
        if self.workers is not None:
            logits = self.workers.run_step(inputs, self.run)
        else:
            logits = self.run(inputs)
        if batch is None and not micro:
            return StepResult([], [], 0, 0)
        parts = micro or [batch]
        logits, scored, pooled = (_join_rows(logits, micro) if micro
                                  else _split_rows(logits, batch))
        result = SamplerOutput([], [])
        if len(step.sampling):
            result = self.sampler(logits, step.sampling)
        out = StepResult(result.token_ids, result.logprobs,
                         sum(b.num_prompt_tokens for b in parts),
                         sum(len(b.input_ids) for b in parts))
        asks = [c for c in step.chunks if c.prompt_logprobs is not None]
        if asks:
            out.prompt_logprobs = score_prompt_positions(
                scored, [c.start for c in asks], [c.prompt_logprobs for c in asks])
        pool_keys = [c.pool_key for c in step.chunks if c.pool_key is not None]
        if pool_keys:
            out.pooled = dict(zip(pool_keys, pooled.float().cpu()))
        return out

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """This rank's part of a step: block moves, the forward, the logits of the rows that
        sample (on rank 0; None elsewhere, and when no row samples)."""
        if inputs.swap_out or inputs.swap_in:
            self.kv_cache.swap(self.host_cache, inputs.swap_out, inputs.swap_in)
        self.kv_cache.load_blocks(inputs.kv_load)  # tier hits, before anything reads them
        self.kv_cache.copy_blocks(inputs.block_copies)
        if self.pipeline is not None:
            return self._run_stage(inputs.micro_batches)
        if inputs.batch is None:
            return None
        host = inputs.batch
        hidden, embeds = None, None
        if host.mm_rows is not None:  # image embeddings at their placeholders' rows
            batch = self._to_device(host)
            embeds = self.model.embed(batch.input_ids)
            rows = torch.from_numpy(host.mm_rows).to(self.device)
            embeds[rows] = host.mm_embeds.to(embeds.dtype)
        elif (self.cuda_graphs is not None and host.num_decodes == len(host.input_ids)
              and (host.rope_positions is None or host.rope_positions.ndim == 1)):
            hidden = self.cuda_graphs.run(host)  # None: no bucket this large
        if hidden is None and embeds is None:
            batch = self._to_device(host)
            if self.decode_stack is not None:
                hidden = self.decode_stack(batch.input_ids, batch.positions, batch.meta,
                                           batch.rope_seq_lens)
        if hidden is None:
            self.model.prepare(batch.meta)
            hidden = self.model(batch.input_ids, batch.positions, batch.meta,
                                self.kv_cache.layers, batch.rope_seq_lens,
                                inputs_embeds=embeds)
        self.kv_cache.offload_blocks(inputs.kv_store)  # blocks this forward filled
        if not len(host.logits_indices):
            return None
        logits_indices = torch.from_numpy(host.logits_indices).to(self.device)
        if host.num_pooled_rows:  # the pooling runner: final hidden states, no LM head
            return self.model.norm(hidden[logits_indices])
        return self.model.compute_logits(hidden[logits_indices])

    def _run_stage(self, micro_batches: list[HostBatch]) -> list[torch.Tensor | None] | None:
        """This pipeline stage's part of each micro-batch, in order; on rank 0, the rows to
        sample (or score, or pool) of each (None where it has none)."""
        links, model = self.pipeline, self.model
        pending, rows = [], []
        for host in micro_batches:
            batch = self._to_device(host)
            model.prepare(batch.meta)
            if links.is_first:
                x, residual = model.embed(batch.input_ids), None
            else:
                x, residual = links.recv_hidden(len(host.input_ids),
                                                not model.keeps_own_residual)
            x, residual = model.forward_stage(x, residual, batch.positions, batch.meta,
                                              self.kv_cache.layers, batch.rope_seq_lens)
            if not links.is_last:
                pending += links.send_hidden(x, residual)
                continue
            out = None
            if len(host.logits_indices):
                hidden = x if residual is None else residual + x
                picked = hidden[batch.logits_indices]
                out = (model.norm(picked) if host.num_pooled_rows
                       else model.compute_logits(picked))
            if links.sends_logits and out is not None:
                pending += links.send_rows(out)
        if links.rank == 0:  # the first stage: the last stage's rows come back
            rows = [links.recv_rows(len(h.logits_indices), bool(h.num_pooled_rows))
                    if len(h.logits_indices) else None for h in micro_batches]
        wait_all(pending)
        return rows if links.rank == 0 else None

    def _prepare(self, step: StepBatch, chunks: list[SequenceChunk] | None = None
                 ) -> HostBatch:
        """One flat batch of the step's chunks (of `chunks`, a micro-batch of them, already
        with their verification rows as decodes)."""
        chunks = _verification_as_decodes(step.chunks) if chunks is None else chunks
        tokens: list[int] = []
        logits_indices: list[int] = []
        scored: list[int] = []  # prompt positions whose logits are scored (prompt logprobs)
        pooled: list[int] = []  # positions whose hidden states are pooled
        end = 0
        for c in chunks:
            first = end
            end += len(c.token_ids)
            tokens.extend(c.token_ids)
            logits_indices.extend([end - 1] * c.num_samples)  # its rows sample its last token
            if c.prompt_logprobs is not None:
                scored.extend(range(first, first + len(c.prompt_logprobs.target_ids)))
            if c.pool_key is not None:
                pooled.append(end - 1)
        num_sample_rows = len(logits_indices)
        logits_indices += scored + pooled
        b = len(chunks)
        starts_a = np.asarray([c.start for c in chunks], dtype=np.int64)
        ns_a = np.asarray([len(c.token_ids) for c in chunks], dtype=np.int64)
        qsl = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(ns_a, out=qsl[1:])
        seq_idx = np.repeat(np.arange(b), ns_a)
        positions = np.arange(len(tokens), dtype=np.int64) - qsl[seq_idx] + starts_a[seq_idx]
        tables = [c.block_table for c in chunks]
        width = max(len(t) for t in tables)
        bt = np.zeros((b, width), dtype=np.int32)
        for j, t in enumerate(tables):
            bt[j, : len(t)] = t
        bs = self.block_size
        slots = bt[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = starts_a + ns_a
        if self.lora is not None:  # slots for the step's adapters, and each token's slot
            self.lora.prepare([c.lora for c in chunks], ns_a, step.lora_keys_in_use)
        prompt_a = np.asarray([c.num_prompt_tokens for c in chunks], dtype=np.int64)
        num_prompt_tokens = int(np.minimum(np.maximum(prompt_a - starts_a, 0), ns_a).sum())
        rope_seq_lens = None
        if self.dynamic_rope:  # what transformers' dynamic NTK sees: the prompt, then growth
            # (LongRoPE: all the sequence's known tokens, since it recomputes at the switch)
            rope_lens = (np.asarray([c.num_tokens for c in chunks], dtype=np.int64)
                         if self.long_rope else prompt_a)
            rope_seq_lens = np.maximum(positions + 1, rope_lens[seq_idx])
        mm = self.mm.gather(chunks) if self.mm is not None else None
        return HostBatch(
            mm_rows=None if mm is None else mm[0], mm_embeds=None if mm is None else mm[1],
            key_limits=_image_key_limits(chunks) if self.mm_bidirectional else None,
            rope_positions=mrope_positions(chunks, positions, qsl) if self.mrope else None,
            input_ids=np.asarray(tokens, dtype=np.int64), positions=positions,
            query_start_loc=qsl, seq_lens=seq_lens, block_tables=bt, slot_mapping=slots,
            num_decodes=_num_decodes(chunks), rope_seq_lens=rope_seq_lens,
            logits_indices=np.asarray(logits_indices, dtype=np.int64),
            num_prompt_tokens=num_prompt_tokens, num_sample_rows=num_sample_rows,
            num_pooled_rows=len(pooled))

    def _to_device(self, b: HostBatch) -> _Batch:
        dev = self.device
        qsl, seq_lens = b.query_start_loc, b.seq_lens
        meta = AttentionMetadata(
            num_decodes=b.num_decodes,
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(b.block_tables).to(dev),
            slot_mapping=torch.from_numpy(b.slot_mapping).to(dev),
            max_query_len=int(np.diff(qsl).max()),
            max_seq_len=int(seq_lens.max()),
            block_size=self.block_size,
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            key_limits=(None if b.key_limits is None
                        else torch.from_numpy(b.key_limits.astype(np.int32)).to(dev)),
        )
        rope_seq_lens = None if b.rope_seq_lens is None else torch.from_numpy(b.rope_seq_lens)
        positions = b.positions if b.rope_positions is None else b.rope_positions
        return _Batch(
            input_ids=torch.from_numpy(b.input_ids).to(dev),
            positions=torch.from_numpy(positions).to(dev),
            meta=meta,
            rope_seq_lens=rope_seq_lens,
            logits_indices=torch.from_numpy(b.logits_indices).to(dev),
            num_prompt_tokens=b.num_prompt_tokens,
        )


def mrope_positions(chunks: list[SequenceChunk], positions: np.ndarray, qsl: np.ndarray
                    ) -> np.ndarray | None:
    """An M-RoPE model's rotary positions for the batch, from each chunk's sequence's stored
    triples (never from the chunk: one that starts mid-prompt slices them): None when no
    chunk has triples (text prompts: `positions` are theirs); [T] when every chunk lies past
    its prompt (decodes, verification: the three are equal, p + delta); else [3, T]."""
    if all(c.mrope is None for c in chunks):
        return None
    spans = [(c, c.start, c.start + len(c.token_ids), positions[qsl[j]:qsl[j + 1]])
             for j, c in enumerate(chunks)]
    flat = [own if c.mrope is None else c.mrope.shifted(lo, hi) for c, lo, hi, own in spans]
    if all(f is not None for f in flat):
        return np.concatenate(flat)
    return np.concatenate([np.broadcast_to(own, (3, len(own))) if c.mrope is None
                           else c.mrope.rows(lo, hi) for c, lo, hi, own in spans], axis=1)


def _join_rows(per_micro_batch: list, micro: list[HostBatch]):
    """_split_rows of each micro-batch, joined in order."""
    parts = [_split_rows(rows, b) for rows, b in zip(per_micro_batch, micro)
             if rows is not None]
    joined = []
    for i in range(3):
        got = [p[i] for p in parts if p[i] is not None and len(p[i])]
        joined.append(torch.cat(got) if got else None)
    return tuple(joined)


def _split_rows(logits: torch.Tensor | None, batch: HostBatch):
    """The rows that sample; those scored for prompt logprobs; the pooled hidden states."""
    if logits is None or batch.num_sample_rows < 0:
        return logits, None, None
    if batch.num_pooled_rows:
        return None, None, logits
    return logits[:batch.num_sample_rows], logits[batch.num_sample_rows:], None


def _verification_as_decodes(chunks: list[SequenceChunk]) -> list[SequenceChunk]:
    """A sequence verifying k proposals computes k + 1 tokens and needs the logits of each:
    as k + 1 one-token rows over its block table, at consecutive positions, each attending up
    to its own position. Every layer writes the whole batch's K/V before any row attends, so
    these are the rows of causal attention over the chunk; they join the decodes, which the
    attention backends, the native decode stack and CUDA graphs batch."""
    if not any(c.num_verified for c in chunks):
        return chunks
    out = []
    for c in chunks:
        if not c.num_verified:
            out.append(c)
            continue
        out += [SequenceChunk([token], c.start + j, c.num_prompt_tokens, c.num_tokens,
                              c.block_table, 1, c.lora, mrope=c.mrope)
                for j, token in enumerate(c.token_ids)]
    return out


def _image_key_limits(chunks: list[SequenceChunk]) -> np.ndarray | None:
    """The flat batch's key limits (multimodal/image_attention.py), or None when no chunk
    holds a token of an image's run that looks ahead."""
    if not any(c.images for c in chunks):
        return None
    parts, ahead = [], False
    for c in chunks:
        own = key_limits(c.images, c.start, len(c.token_ids)) if c.images else None
        ahead |= own is not None
        parts.append(own if own is not None else
                     np.arange(c.start, c.start + len(c.token_ids), dtype=np.int64))
    return np.concatenate(parts) if ahead else None


def _num_decodes(chunks: list[SequenceChunk]) -> int:
    """The leading one-token rows."""
    n = 0
    while n < len(chunks) and len(chunks[n].token_ids) == 1:
        n += 1
    return n
