"""Draft-model proposals: a smaller model with the target's vocabulary guesses the next k
tokens greedily; the target verifies them in its step (rejection.py treats a greedy draft as
a point mass, which keeps sampling exact).

The draft keeps its own KV cache with the target's block layout: the same block ids and slots
(the scheduler's tables), its own tensors. A sequence's draft KV is valid below
`spec.draft_computed`; each proposal round first feeds the draft what it has not seen (the
whole prompt the first time, then the one or two tokens the last verification committed),
then k - 1 one-token steps. Every position it writes lies inside the slots the scheduler gave
the step (the sequence's known token and its k proposals), so it never touches another
sequence's blocks. Copy-on-write copies are mirrored into the draft's cache; a preempted
sequence (its blocks recomputed or swapped) starts its draft KV over.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from quire.models.config import ModelConfig
from quire.models.loader import load_hf_config, load_tokenizer, materialize, resolve_model
from quire.sampling_batch import SamplingBatch
from quire.step_batch import SequenceChunk, StepBatch
from quire.validation import QuireValidationError
from quire.worker.kv_cache import KVCache
from quire.worker.model_builder import build_model
from quire.worker.model_runner import ModelRunner
from quire.worker.sampler import Sampler

logger = logging.getLogger(__name__)


class DraftProposer:
    def __init__(self, config, args, target_cfg: ModelConfig, target_tokenizer,
                 num_blocks: int, block_size: int, dtype: torch.dtype, kv_dtype: torch.dtype,
                 device: torch.device, max_model_len: int) -> None:
        quantization = config.quantization or args.quantization
        source = materialize(resolve_model(config.model, None, args.download_dir), quantization)
        self.model_config = cfg = ModelConfig.from_hf(load_hf_config(source, None))
        _check_same_vocabulary(config.model, cfg, load_tokenizer(source, None), target_cfg,
                               target_tokenizer)
        draft_args = dataclasses.replace(args, model=config.model, quantization=quantization,
                                         enable_lora=False, tensor_parallel_size=1)
        self.model = build_model(draft_args, source, cfg, dtype, device,
                                 min(max_model_len, cfg.max_position_embeddings))
        self.kv_cache = KVCache(cfg.num_layers, num_blocks, block_size,
                                self.model.num_kv_heads_per_rank, cfg.head_dim, kv_dtype, device)
        self.runner = ModelRunner(self.model, self.kv_cache, Sampler(cfg.vocab_size, device, 0),
                                  block_size, device, cuda_graphs=False)
        logger.info("draft model %s (%s, %d layers) proposes for %s", config.model,
                    cfg.architecture, cfg.num_layers, target_cfg.architecture)

    def mirror_copies(self, sched) -> None:
        """The target copies these blocks this step (copy-on-write): so does the draft."""
        if sched.block_copies:
            self.kv_cache.copy_blocks(sched.block_copies)

    def fill(self, sched) -> None:
        """Write the draft's proposals into the sequences' proposal lists (in place: the
        scheduler output holds the same lists)."""
        rows = [(seq, table, sched.spec_token_ids[seq.request_id])
                for seq, table in zip(sched.requests, sched.block_tables)
                if seq.request_id in sched.spec_token_ids]
        for seq, _, _ in rows:
            state = seq.spec
            if state.draft_preemptions != seq.num_preemptions:  # its blocks are new
                state.draft_computed, state.draft_preemptions = 0, seq.num_preemptions
            state.draft_computed = min(state.draft_computed, seq.num_computed_tokens)
        # round 0: what the draft has not seen, up to the sequence's known last token
        chunks = [SequenceChunk(seq.token_ids[seq.spec.draft_computed:], seq.spec.draft_computed,
                                seq.num_prompt_tokens, seq.num_tokens, table, 1)
                  for seq, table, _ in rows]
        guesses = self._greedy(chunks)
        for (seq, _, proposals), token in zip(rows, guesses):
            proposals[0] = token
            seq.spec.draft_computed = seq.num_tokens
        for j in range(1, max(len(p) for _, _, p in rows)):
            live = [(seq, table, p) for seq, table, p in rows if len(p) > j]
            chunks = [SequenceChunk([p[j - 1]], seq.num_tokens - 1 + j, seq.num_prompt_tokens,
                                    seq.num_tokens + j, table, 1) for seq, table, p in live]
            for (seq, _, proposals), token in zip(live, self._greedy(chunks)):
                proposals[j] = token
                seq.spec.draft_computed = seq.num_tokens + j

    def _greedy(self, chunks: list[SequenceChunk]) -> list[int]:
        # decodes (one token) first, as the runner's batches have them
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) != 1)
        step = StepBatch([], [], [], [chunks[i] for i in order], _greedy_rows(len(order)))
        tokens = self.runner.execute(step).token_ids
        out = [0] * len(order)
        for pos, i in enumerate(order):  # back to the callers' order
            out[i] = tokens[pos]
        return out


def _greedy_rows(n: int) -> SamplingBatch:
    return SamplingBatch(
        greedy=[True] * n, temperature=[0.0] * n, top_k=[0] * n, top_p=[1.0] * n,
        min_p=[0.0] * n, logprobs=[None] * n, repetition_penalty=[1.0] * n,
        presence_penalty=[0.0] * n, frequency_penalty=[0.0] * n, penalized=[False] * n,
        prompt_token_ids=[[]] * n, output_token_ids=[[]] * n, generators=[None] * n,
        banned_token_ids=[[]] * n)


def _check_same_vocabulary(name: str, cfg: ModelConfig, tokenizer, target_cfg: ModelConfig,
                           target_tokenizer) -> None:
    if cfg.vocab_size != target_cfg.vocab_size or tokenizer.get_vocab() != \
            target_tokenizer.get_vocab():
        raise QuireValidationError(
            "speculative_config.model",
            f"speculative_config.model {name!r} must share the target's vocabulary: its "
            f"vocab_size is {cfg.vocab_size} (the target's {target_cfg.vocab_size}) and its "
            "tokenizer's token ids must be the target's")
