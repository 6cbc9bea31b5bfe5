"""Turns a scheduled step into one flat, unpadded batch, runs the model, samples.

The only part of the engine that touches tensors. Host-side preparation is vectorized with
numpy: a Python loop per request, never per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from quire.attention.base import AttentionMetadata
from quire.engine.request import Request
from quire.engine.scheduler import SchedulerOutput
from quire.worker.kv_cache import KVCache
from quire.worker.sampler import Sampler, SamplerOutput


@dataclass
class StepResult:
    sampled: dict[str, int]                 # request id -> new token
    logprobs: dict[str, tuple]              # request id -> (lp, rank, top ids, top lps)
    num_prompt_tokens: int                  # tokens computed this step that lie in a prompt
    num_tokens: int                         # all tokens computed this step


@dataclass
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    rope_seq_lens: torch.Tensor | None
    logits_indices: torch.Tensor
    sample_rows: list[Request]
    num_prompt_tokens: int


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, sampler: Sampler, block_size: int,
                 device: torch.device, host_cache: KVCache | None = None,
                 lora=None) -> None:
        self.model = model
        self.lora = lora  # a quire.lora LoRAManager, when LoRA is on
        self.kv_cache = kv_cache
        self.host_cache = host_cache  # swap space
        self.sampler = sampler
        self.block_size = block_size
        self.device = device
        self.dynamic_rope = model.rope.rope_type == "dynamic"

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        if out.swap_out or out.swap_in:
            self.kv_cache.swap(self.host_cache, out.swap_out, out.swap_in)
        self.kv_cache.copy_blocks(out.block_copies)
        if not out.requests:
            return StepResult({}, {}, 0, 0)
        batch = self._prepare(out)
        self.model.prepare(batch.meta)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache.layers,
                            batch.rope_seq_lens)
        sampled, logprobs = {}, {}
        if batch.sample_rows:
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            result: SamplerOutput = self.sampler(logits, batch.sample_rows)
            for req, tok, lp in zip(batch.sample_rows, result.token_ids, result.logprobs):
                sampled[req.request_id] = tok
                if lp is not None:
                    logprobs[req.request_id] = lp
        return StepResult(sampled, logprobs, batch.num_prompt_tokens, len(batch.input_ids))

    def _prepare(self, out: SchedulerOutput) -> _Batch:
        reqs, counts = out.requests, out.num_new_tokens
        # decodes (one query token) first: backends batch them
        order = [i for i, n in enumerate(counts) if n == 1]
        num_decodes = len(order)
        order += [i for i, n in enumerate(counts) if n != 1]
        tokens: list[int] = []
        starts, ns, prompt_lens = [], [], []
        sample_rows: list[Request] = []
        logits_indices: list[int] = []
        end = 0
        for i in order:
            r, n = reqs[i], counts[i]
            s = r.num_computed_tokens
            tokens.extend(r.token_ids[s:s + n])
            starts.append(s)
            ns.append(n)
            prompt_lens.append(r.num_prompt_tokens)
            end += n
            if s + n == r.num_tokens:  # reaches the last known token: sample the next
                for row in (r, *out.forks.get(r.request_id, ())):
                    sample_rows.append(row)
                    logits_indices.append(end - 1)
        b = len(order)
        starts_a = np.asarray(starts, dtype=np.int64)
        ns_a = np.asarray(ns, dtype=np.int64)
        qsl = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(ns_a, out=qsl[1:])
        seq_idx = np.repeat(np.arange(b), ns_a)
        positions = np.arange(len(tokens), dtype=np.int64) - qsl[seq_idx] + starts_a[seq_idx]
        tables = [out.block_tables[i] for i in order]
        width = max(len(t) for t in tables)
        bt = np.zeros((b, width), dtype=np.int32)
        for j, t in enumerate(tables):
            bt[j, : len(t)] = t
        bs = self.block_size
        slots = bt[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = starts_a + ns_a
        if self.lora is not None:  # slots for the step's adapters, and each token's slot
            self.lora.prepare([reqs[i].lora for i in order], ns_a, out.lora_keys_in_use)
        prompt_a = np.asarray(prompt_lens, dtype=np.int64)
        num_prompt_tokens = int(np.minimum(np.maximum(prompt_a - starts_a, 0), ns_a).sum())
        dev = self.device
        meta = AttentionMetadata(
            num_decodes=num_decodes,
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(bt).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            max_query_len=int(ns_a.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=bs,
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        rope_seq_lens = None
        if self.dynamic_rope:  # what transformers' dynamic NTK sees: the prompt, then growth
            rope_seq_lens = torch.from_numpy(np.maximum(positions + 1, prompt_a[seq_idx]))
        return _Batch(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=dev),
            positions=torch.from_numpy(positions).to(dev),
            meta=meta,
            rope_seq_lens=rope_seq_lens,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            sample_rows=sample_rows,
            num_prompt_tokens=num_prompt_tokens,
        )
