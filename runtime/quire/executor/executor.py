"""Executor: owns the model runner, the KV tensors (and the swap space's), the sampler, the
LoRA slots, the draft model and the tensor- and pipeline-parallel workers, and runs one step
from the scheduler's plain output (vLLM v1's executor: one process plus optional workers, on
this node or others).

It also keeps what must outlive a step on the tensor side: each seeded sequence's own
generator, keyed by sequence id, made on first sight from the row's seed and dropped when
the scheduler reports the sequence finished.
"""

from __future__ import annotations

import logging

import torch

from quire.config import EngineArgs
from quire.distributed.pipeline import PipelineLinks
from quire.distributed.workers import Workers
from quire.distributed.world import World
from quire.models.config import ModelConfig
from quire.validation import QuireValidationError
from quire.worker.kv_cache import KVCache, bytes_per_block, kv_budget, kv_torch_dtype
from quire.worker.model_builder import build_model
from quire.worker.model_runner import ModelRunner, StepResult
from quire.worker.sampler import Sampler

logger = logging.getLogger(__name__)


class Executor:
    def __init__(self, args: EngineArgs, source, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device, max_model_len: int) -> None:
        self.args, self.cfg, self.device = args, cfg, device
        self.block_size = args.block_size
        self.kv_dtype = kv_dtype = kv_torch_dtype(args.kv_cache_dtype, dtype)
        self.max_model_len = max_model_len
        # tensor x pipeline ranks (quire.distributed.world); this process is rank 0, the
        # others are workers (None at size 1)
        self.world = world = World.from_args(args, cfg.num_layers)
        self.workers = Workers.start(args, source, cfg, dtype, kv_dtype, device, max_model_len,
                                     world)
        self.model = build_model(args, source, cfg, dtype, device, max_model_len, 0,
                                 world.tp, world.stage(0))
        self.num_stage_layers = len(self.model.stage_layers)  # what this rank's KV cache holds
        self.attention_backend = next(iter(self.model.backends.values())).name
        self.lora_manager = None  # the adapters' device slots, when LoRA is on
        if args.enable_lora:
            from quire.lora.manager import LoRAManager
            self.lora_manager = LoRAManager(
                self.model, args.max_loras, args.max_lora_rank,
                args.max_cpu_loras or args.max_loras, dtype, device,
                self.attention_backend == "triton")
        self.kv_cache = self._allocate_kv_cache()
        self.host_cache = self._swap_space()
        self.sampler = Sampler(cfg.vocab_size, device, args.seed)
        self.runner = ModelRunner(self.model, self.kv_cache, self.sampler, self.block_size,
                                  device, self.host_cache, self.workers, self.lora_manager,
                                  cuda_graphs=not args.enforce_eager,
                                  max_num_seqs=args.max_num_seqs,
                                  pipeline=PipelineLinks.of(0, world.size, world.tp, cfg, dtype,
                                                            device))
        self.draft_model = None  # speculative decoding's draft, built by build_draft_model
        self.multimodal = self.runner.mm  # images' pixels, encoder runs and cache (or None)
        self.generators: dict[str, torch.Generator] = {}  # seeded sequences' own

    # --- construction ----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def num_host_blocks(self) -> int:
        return 0 if self.host_cache is None else self.host_cache.num_blocks

    def _bytes_per_block(self) -> int:
        return bytes_per_block(self.num_stage_layers, self.block_size,
                               self.model.num_kv_heads_per_rank, self.cfg.head_dim,
                               self.kv_dtype)

    def _allocate_kv_cache(self) -> KVCache:
        per_block = self._bytes_per_block()
        budget = kv_budget(self.device, self.args.kv_cache_memory,
                           self.args.kv_cache_memory_fraction)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise QuireValidationError(
                "kv_cache_memory", f"kv_cache_memory of {budget} bytes holds no block; one "
                f"block of {self.block_size} tokens needs {per_block} bytes", budget)
        cache = KVCache(self.num_stage_layers, num_blocks, self.block_size,
                        self.model.num_kv_heads_per_rank, self.cfg.head_dim, self.kv_dtype,
                        self.device)
        tokens = num_blocks * self.block_size
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s); %.1f "
                    "max-length (%d) sequences fit", num_blocks, self.block_size, tokens,
                    cache.nbytes / 2**30, str(self.kv_dtype).removeprefix("torch."),
                    tokens / self.max_model_len, self.max_model_len)
        return cache

    def _swap_space(self) -> KVCache | None:
        if self.args.preemption_mode != "swap":
            return None
        per_block = self._bytes_per_block()
        num_host_blocks = self.args.swap_space // per_block
        if num_host_blocks < 1:
            raise QuireValidationError(
                "swap_space", f"swap_space of {self.args.swap_space} bytes holds no block; one "
                f"block needs {per_block} bytes", self.args.swap_space)
        host = KVCache(self.num_stage_layers, num_host_blocks, self.block_size,
                       self.model.num_kv_heads_per_rank, self.cfg.head_dim, self.kv_dtype,
                       torch.device("cpu"), pin_memory=self.device.type == "cuda")
        logger.info("swap space: %d host blocks (%.2f GiB)", num_host_blocks, host.nbytes / 2**30)
        return host

    def build_draft_model(self, config, tokenizer, dtype: torch.dtype):
        """Speculative decoding's draft model, over this executor's block layout."""
        from quire.worker.draft_model import DraftModel
        self.draft_model = DraftModel(config, self.args, self.cfg, tokenizer, self.num_blocks,
                                      self.block_size, dtype, self.kv_dtype, self.device,
                                      self.max_model_len)
        return self.draft_model

    # --- images ------------------------------------------------------------------------------
    def add_images(self, owner: str, pixels: dict[str, dict]) -> None:
        """A request's images' processor tensors by hash, held until `release_images`."""
        self.multimodal.add(owner, pixels)

    def release_images(self, owner: str) -> None:
        if self.multimodal is not None:
            self.multimodal.release(owner)

    # --- the step ----------------------------------------------------------------------------
    def execute(self, out) -> StepResult:
        """Run one SchedulerOutput: block moves, the forward, sampling."""
        for rid in out.finished_ids:
            self.generators.pop(rid, None)
        if out.empty:
            return StepResult([], [], 0, 0)
        sampling = out.batch.sampling
        sampling.generators = [self._generator(rid, seed)
                               for rid, seed in zip(sampling.row_ids, sampling.seeds)]
        return self.runner.execute(out.batch)

    def _generator(self, seq_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = self.generators.get(seq_id)
        if generator is None:
            generator = self.generators[seq_id] = self.sampler.make_generator(seed)
        return generator

    def check_workers(self) -> None:
        """Raises (TensorParallelError) if a worker has died: the engine cannot go on."""
        if self.workers is not None:
            self.workers.check()

    def shutdown(self) -> None:
        """Stop the workers (a no-op at size 1); safe to call twice."""
        if self.workers is not None:
            self.workers.shutdown()
