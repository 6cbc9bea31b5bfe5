"""A draft model for speculative decoding, on the executor's side: a smaller model with the
target's vocabulary, its own KV tensors over the target's block layout (the same block ids
and slots, its own tensors), its own runner, and greedy steps over plain chunks. The
bookkeeping (which tokens each sequence feeds it) is spec_decode/draft.py's."""

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


class DraftModel:
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

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """The target copies these blocks this step (copy-on-write): so does the draft."""
        if copies:
            self.kv_cache.copy_blocks(copies)

    def greedy(self, chunks: list[SequenceChunk]) -> list[int]:
        """Each chunk's next token, greedily, its K/V written into the draft's cache."""
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
        prompt_token_ids=[[]] * n, output_token_ids=[[]] * n, banned_token_ids=[[]] * n,
        row_ids=[""] * n, seeds=[None] * n, generators=[None] * n)


def _check_same_vocabulary(name: str, cfg: ModelConfig, tokenizer, target_cfg: ModelConfig,
                           target_tokenizer) -> None:
    if cfg.vocab_size != target_cfg.vocab_size or tokenizer.get_vocab() != \
            target_tokenizer.get_vocab():
        raise QuireValidationError(
            "speculative_config.model",
            f"speculative_config.model {name!r} must share the target's vocabulary: its "
            f"vocab_size is {cfg.vocab_size} (the target's {target_cfg.vocab_size}) and its "
            "tokenizer's token ids must be the target's")
