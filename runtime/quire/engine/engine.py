"""LLMEngine: add_request, abort_request, step.

Builds the pieces (model, KV cache, block pool, scheduler, runner, sampler) and drives one
step at a time: schedule -> run the model -> update sequences -> detokenize -> outputs.

Names: `kv_cache` is the worker's KV tensors; `kv_manager` the KVCacheManager (block tables);
a client request becomes one or more sequences (`Request` objects), its sibling group; a beam
search becomes a beam group (see request.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence

import torch

from quire.config import EngineArgs
from quire.cpu_threads import configure_threads
from quire.distributed.errors import TensorParallelError
from quire.distributed.workers import Workers
from quire.engine.batch_builder import build_step_batch
from quire.engine.beam_search import (
    BeamSearchGroup,
    BeamSearchParams,
    advance_beam_groups,
    num_blocks_for_beam_search,
)
from quire.engine.block_hash import check_cache_salt
from quire.engine.block_pool import BlockPool
from quire.engine.kv_cache_manager import KVCacheManager
from quire.engine.output_processor import OutputProcessor
from quire.engine.request import Request, RequestStatus
from quire.engine.scheduler import Scheduler
from quire.engine.stats import EngineSnapshot, StepEvents
from quire.engine.swap_manager import SwapManager
from quire.kv_tiers.setup import build_kv_tiers
from quire.lora.adapters import EngineAdapters, tag_request
from quire.lora.request import LoRARequest
from quire.models.config import ModelConfig
from quire.models.loader import load_hf_config, load_tokenizer, materialize, resolve_model
from quire.outputs import RequestOutput, TokenLogprobs
from quire.platform import default_step_budget, resolve_device, resolve_dtype
from quire.sampling_params import MAX_SEED, SamplingParams
from quire.spec_decode.config import SpeculativeConfig
from quire.spec_decode.draft import DraftProposer
from quire.spec_decode.speculator import Speculator
from quire.structured.manager import StructuredOutputManager
from quire.validation import QuireValidationError, check_int
from quire.worker.kv_cache import KVCache, bytes_per_block, kv_budget, kv_torch_dtype
from quire.worker.model_builder import build_model
from quire.worker.model_runner import ModelRunner
from quire.worker.sampler import Sampler

logger = logging.getLogger(__name__)

PromptType = str | Sequence[int] | dict


class LLMEngine:
    def __init__(self, args: EngineArgs, serving: bool = False) -> None:
        """`serving`: an HTTP server's event loop shares the CPUs (cpu_threads.py)."""
        self.num_threads = configure_threads(args.num_threads, serving)
        t0 = time.perf_counter()
        self.device = resolve_device(args.device)
        if args.max_num_batched_tokens is None:  # the engine's args say what it runs with
            args = dataclasses.replace(args, max_num_batched_tokens=default_step_budget(
                self.device, self.num_threads))
        self.args = args
        source = resolve_model(args.model, args.revision, args.download_dir)
        source = materialize(source, args.quantization)  # a GGUF becomes its cached folder
        self.model_name = source.name
        self.model_config = cfg = ModelConfig.from_hf(load_hf_config(source, args.revision))
        self.tokenizer = load_tokenizer(source, args.tokenizer)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.max_model_len = self._max_model_len(cfg)
        self.block_size = args.block_size

        self.kv_dtype = kv_torch_dtype(args.kv_cache_dtype, self.dtype)
        # tensor parallelism: ranks 1..N-1 (None at size 1); this process is rank 0
        self.workers = Workers.start(args, source, cfg, self.dtype, self.kv_dtype,
                                     self.device, self.max_model_len)
        self.model = build_model(args, source, cfg, self.dtype, self.device,
                                 self.max_model_len, 0, args.tensor_parallel_size)
        self.attention_backend = next(iter(self.model.backends.values())).name
        self.lora = None  # LoRA adapters: registry, device slots, the scheduler's rule
        if args.enable_lora:
            self.lora = EngineAdapters(args, self.model, self.dtype, self.device,
                                       use_triton=self.attention_backend == "triton")

        self.kv_cache = self._allocate_kv_cache(cfg)
        pool = BlockPool(self.kv_cache.num_blocks, args.enable_prefix_caching)
        # KV tiers under the pool and KV-cache events (issue 44), each None when off
        self.kv_tiers, self.kv_events = build_kv_tiers(
            args, model_path=source.path, dtype=self.dtype, kv_dtype=self.kv_dtype,
            num_layers=cfg.num_layers, num_kv_heads=self.model.num_kv_heads_per_rank,
            head_dim=cfg.head_dim)
        if self.kv_tiers is not None:
            self.kv_cache.tier_sink = self.kv_tiers.store
        self.kv_manager = KVCacheManager(pool, self.block_size, self.kv_tiers, self.kv_events)
        self.swap_manager, host_cache = self._swap_space(cfg)
        self.scheduler = Scheduler(self.kv_manager, args.max_num_seqs,
                                   args.max_num_batched_tokens, self.swap_manager,
                                   self.lora.admission if self.lora else None,
                                   self._rope_switch_length())
        self.eos_token_ids = self._eos_token_ids(cfg)
        self.structured = StructuredOutputManager(self.tokenizer, cfg.vocab_size,
                                                  self.eos_token_ids)  # guided decoding
        self.sampler = Sampler(cfg.vocab_size, self.device, args.seed)
        self.runner = ModelRunner(self.model, self.kv_cache, self.sampler, self.block_size,
                                  self.device, host_cache, self.workers,
                                  self.lora.manager if self.lora else None,
                                  cuda_graphs=not args.enforce_eager,
                                  max_num_seqs=args.max_num_seqs)
        self.speculator = self._speculator(cfg)  # speculative decoding, when configured
        self.output_processor = OutputProcessor(self.tokenizer)
        self.events = StepEvents()
        self.num_prompt_tokens_computed = 0  # lifetime, for tests and benchmarks
        self._aborted_outputs: list[RequestOutput] = []
        self.beam_groups: dict[str, BeamSearchGroup] = {}
        self._ids = itertools.count()
        logger.info("loaded %s (%s, %s, attention %s, %d tokens per step) in %.1fs",
                    self.model_name, cfg.architecture, str(self.dtype).removeprefix("torch."),
                    self.attention_backend, args.max_num_batched_tokens,
                    time.perf_counter() - t0)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op at size 1); safe to call twice."""
        if self.workers is not None:
            self.workers.shutdown()
        if self.kv_tiers is not None:
            self.kv_cache.flush_offloads()
            self.kv_tiers.close()
            self.kv_tiers = None
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    @classmethod
    def from_kwargs(cls, **kwargs) -> LLMEngine:
        return cls(EngineArgs(**kwargs))

    # --- construction helpers ------------------------------------------------------------
    def _max_model_len(self, cfg: ModelConfig) -> int:
        limit = cfg.max_position_embeddings
        if self.args.max_model_len is None:
            return limit
        if self.args.max_model_len > limit and cfg.rope_scaling is None:
            raise QuireValidationError(
                "max_model_len", f"max_model_len must be <= {limit} (the model's context "
                f"length), got {self.args.max_model_len}", self.args.max_model_len)
        return self.args.max_model_len

    def _allocate_kv_cache(self, cfg: ModelConfig) -> KVCache:
        per_block = bytes_per_block(cfg.num_layers, self.block_size,
                                    self.model.num_kv_heads_per_rank, cfg.head_dim, self.kv_dtype)
        budget = kv_budget(self.device, self.args.kv_cache_memory,
                           self.args.kv_cache_memory_fraction)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise QuireValidationError(
                "kv_cache_memory", f"kv_cache_memory of {budget} bytes holds no block; one "
                f"block of {self.block_size} tokens needs {per_block} bytes", budget)
        cache = KVCache(cfg.num_layers, num_blocks, self.block_size,
                        self.model.num_kv_heads_per_rank, cfg.head_dim, self.kv_dtype, self.device)
        tokens = num_blocks * self.block_size
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s); %.1f "
                    "max-length (%d) sequences fit", num_blocks, self.block_size, tokens,
                    cache.nbytes / 2**30, str(self.kv_dtype).removeprefix("torch."),
                    tokens / self.max_model_len, self.max_model_len)
        return cache

    def _swap_space(self, cfg: ModelConfig):
        if self.args.preemption_mode != "swap":
            return None, None
        per_block = bytes_per_block(cfg.num_layers, self.block_size,
                                    self.model.num_kv_heads_per_rank, cfg.head_dim, self.kv_dtype)
        num_host_blocks = self.args.swap_space // per_block
        if num_host_blocks < 1:
            raise QuireValidationError(
                "swap_space", f"swap_space of {self.args.swap_space} bytes holds no block; one "
                f"block needs {per_block} bytes", self.args.swap_space)
        host = KVCache(cfg.num_layers, num_host_blocks, self.block_size,
                       self.model.num_kv_heads_per_rank, cfg.head_dim, self.kv_dtype,
                       torch.device("cpu"), pin_memory=self.device.type == "cuda")
        logger.info("swap space: %d host blocks (%.2f GiB)", num_host_blocks, host.nbytes / 2**30)
        return SwapManager(self.kv_manager, num_host_blocks), host

    def _speculator(self, cfg: ModelConfig) -> Speculator | None:
        config = SpeculativeConfig.parse(self.args.speculative_config)
        if config is None:
            return None
        draft = None
        if config.method == "draft_model":
            draft = DraftProposer(config, self.args, cfg, self.tokenizer,
                                  self.kv_cache.num_blocks, self.block_size, self.dtype,
                                  self.kv_dtype, self.device, self.max_model_len)
        logger.info("speculative decoding: %s, %d tokens per step", config.method,
                    config.num_speculative_tokens)
        return Speculator(config, self._rope_switch_length(), draft, self.structured)

    def _rope_switch_length(self) -> int | None:
        """LongRoPE's switch (Phi-3): sequences of this many tokens use the long table."""
        threshold = self.model.rope.long_threshold
        return None if threshold is None else threshold + 1

    def _eos_token_ids(self, cfg: ModelConfig) -> frozenset[int]:
        ids = set(cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    @property
    def capacity_tokens(self) -> int:
        return self.kv_manager.capacity_tokens

    # --- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None,
                    cache_salt: str | None = None) -> str:
        """Validate and queue one request; raises QuireValidationError naming the field.
        lora_request: the adapter it runs with (read on first use); None: the base model.
        cache_salt: requests share prefix-cache blocks only with requests of the same salt
        (None shares with None)."""
        params = params or SamplingParams()
        check_cache_salt(cache_salt)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if self.output_processor.group_of(request_id) is not None:
            raise _in_use(request_id)
        if params.n > self.args.max_num_seqs:
            raise QuireValidationError(
                "n", f"n must be <= max_num_seqs ({self.args.max_num_seqs}): the n samples run "
                f"side by side; got {params.n}", params.n)
        text, token_ids = self._tokenize(prompt)
        max_tokens = self._max_tokens(len(token_ids), params)
        adapter = None if lora_request is None else self._adapters().resolve(lora_request)
        seqs = []
        for i in range(params.n):  # sample i draws with seed + i: one single run reproduces it
            seq_params = params if params.n == 1 else params.clone(
                n=1, seed=None if params.seed is None else (params.seed + i) % (MAX_SEED + 1))
            seq = Request(
                request_id if params.n == 1 else f"{request_id}#{i}", token_ids, seq_params,
                self.eos_token_ids, max_tokens, arrival_time, client_request_id=request_id,
                sample_index=i)
            tag_request(seq, adapter)
            seq.cache_salt = cache_salt
            if seq_params.seed is not None and not seq_params.greedy:
                seq.generator = self.sampler.make_generator(seq_params.seed)
            seqs.append(seq)
        seqs[0].pending_siblings = seqs[1:]
        if params.guided_decoding is not None:  # compiles off this thread; waits till then
            self.structured.attach(seqs, params.guided_decoding)
        self.output_processor.add(request_id, text, token_ids, params, seqs)
        self.scheduler.add_request(seqs[0])
        return request_id

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise QuireValidationError(
                    "prompt", "prompt dict must hold 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt).input_ids
            if not ids:
                raise QuireValidationError("prompt", "prompt must not be empty", prompt)
            return prompt, list(ids)
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise QuireValidationError(
                "prompt", "prompt must be a non-empty string or a non-empty list of token ids",
                prompt)
        vocab = self.model_config.vocab_size
        for t in prompt:
            check_int("prompt token ids", t, lo=0, hi=vocab - 1, what=f"integers in [0, {vocab})",
                      field="prompt")
        return None, list(prompt)

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        limit = min(self.max_model_len, self.capacity_tokens)
        if prompt_len >= limit:
            raise QuireValidationError(
                "prompt",
                f"prompt is {prompt_len} tokens; this model's context is {self.max_model_len} "
                f"tokens and the KV cache holds {self.capacity_tokens}, so prompts must be "
                f"shorter than {limit} tokens")
        if params.max_tokens is None:
            return limit - prompt_len
        if prompt_len + params.max_tokens > self.max_model_len:
            raise QuireValidationError(
                "max_tokens",
                f"max_tokens is too large: this model's maximum context length is "
                f"{self.max_model_len} tokens, and the prompt has {prompt_len}, so max_tokens "
                f"must be <= {self.max_model_len - prompt_len}, got {params.max_tokens}",
                params.max_tokens)
        if prompt_len + params.max_tokens > self.capacity_tokens:
            raise QuireValidationError(
                "max_tokens",
                f"max_tokens is too large: the KV cache holds {self.capacity_tokens} tokens "
                f"and the prompt has {prompt_len}, so max_tokens must be <= "
                f"{self.capacity_tokens - prompt_len}, got {params.max_tokens}",
                params.max_tokens)
        return params.max_tokens

    def add_beam_search(self, request_id: str | None, prompt: PromptType,
                        params: BeamSearchParams, arrival_time: float | None = None) -> str:
        """Queue a beam search; its one output (the best beam_width sequences, best first)
        comes from step() when it finishes."""
        request_id = str(next(self._ids)) if request_id is None else request_id
        if self.speculator is not None:
            raise QuireValidationError(
                "speculative_config", "beam search can't run on an engine with a "
                "speculative_config: its beams choose among the top tokens of every position, "
                "which proposals don't verify; start an engine without speculative decoding")
        if request_id in self.beam_groups or self.output_processor.group_of(request_id):
            raise _in_use(request_id)
        if params.beam_width > self.args.max_num_seqs:
            raise QuireValidationError(
                "beam_width", f"beam_width must be <= max_num_seqs ({self.args.max_num_seqs}), "
                f"got {params.beam_width}", params.beam_width)
        if params.beam_width > self.args.max_num_batched_tokens:
            raise QuireValidationError(
                "beam_width", f"beam_width must be <= max_num_batched_tokens "
                f"({self.args.max_num_batched_tokens}): the beams decode in one step; got "
                f"{params.beam_width}", params.beam_width)
        text, token_ids = self._tokenize(prompt)
        self._max_tokens(len(token_ids), SamplingParams(max_tokens=params.max_tokens))
        need = num_blocks_for_beam_search(len(token_ids), params, self.block_size)
        if need > self.kv_manager.num_blocks:  # the beams' tails are not shared: count each
            raise QuireValidationError(
                "beam_width",
                f"beam_width x max_tokens is too large for the KV cache: {params.beam_width} "
                f"beams of a {len(token_ids)}-token prompt and max_tokens {params.max_tokens} "
                f"can hold {need} blocks of {self.block_size} tokens at once, and the cache has "
                f"{self.kv_manager.num_blocks}; lower beam_width or max_tokens")
        # greedy rows that return the top-2W logprobs; the group chooses the tokens
        seq_params = SamplingParams(temperature=0, logprobs=2 * params.beam_width,
                                    max_tokens=params.max_tokens, ignore_eos=True,
                                    guided_decoding=params.guided_decoding)
        root = Request(f"{request_id}#beam0", token_ids, seq_params, frozenset(),
                       params.max_tokens, arrival_time, client_request_id=request_id)
        if params.guided_decoding is not None:
            self.structured.attach([root], params.guided_decoding)
        group = BeamSearchGroup(request_id, text, root, params, self.eos_token_ids)
        self.beam_groups[request_id] = group
        self.scheduler.add_request(root)
        return request_id

    def _beam_outputs(self, groups: list[BeamSearchGroup]) -> list[RequestOutput]:
        for group in groups:
            del self.beam_groups[group.request_id]
        return [group.output(self.tokenizer) for group in groups]

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            beam_group = self.beam_groups.pop(rid, None)
            if beam_group is not None:
                beam_group.abort(self.scheduler)
                continue
            group = self.output_processor.group_of(rid)
            if group is None:
                continue
            for seq in group.seqs:
                if not seq.finished:
                    self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)
                    self.events.finished_reasons.append("abort")
                    self.events.e2e_latency.append(seq.metrics.finished_time
                                                   - seq.metrics.arrival_time)
            self._aborted_outputs.extend(self.output_processor.outputs({rid}))

    # --- LoRA adapters (quire/lora) -------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and register an adapter; False if it is registered already. ValueError
        names what is wrong (a bad folder, rank > max_lora_rank, a name or id in use)."""
        return self._adapters().add(lora_request)

    def remove_lora(self, name_or_id: str | int) -> bool:
        """Unregister an adapter (running requests finish with it); False if unknown."""
        return self._adapters().remove(name_or_id, self.scheduler.running)

    def list_loras(self) -> list[LoRARequest]:
        return self.lora.list() if self.lora else []

    def get_lora(self, name: str) -> LoRARequest | None:
        """The registered adapter a request's `model` names, if any."""
        return self.lora.get(name) if self.lora else None

    def _adapters(self) -> EngineAdapters:
        if self.lora is None:
            raise QuireValidationError("lora_request",
                                       "lora_request needs an engine with enable_lora=True")
        return self.lora

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted_outputs)

    # --- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._aborted_outputs = self._aborted_outputs, []
        for req, error in self.structured.poll():  # grammars compiled since the last step
            outputs += self._fail([req], error)
        if self.speculator is not None:  # proposals for the running decodes
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched.stuck:  # the liveness guard failed them: nothing could make progress
            outputs += self._fail(sched.stuck, sched.stuck_reason)
        self.structured.resync(sched.preempted)
        if self.lora is not None and sched.requests:  # an adapter that can't get a slot
            outputs += self._fill_lora_slots(sched)   # fails its requests, not the step
            if sched.empty:
                return outputs
        if sched.empty:
            self.structured.wait(0.05)  # nothing runs until a grammar compiles: don't spin
            return outputs
        try:
            if self.speculator is not None:  # a draft model's proposals, now they have slots
                self.speculator.fill(sched)
            batch, rows = build_step_batch(sched, self.sampler.make_generator, self.structured)
            batch.kv_load, batch.kv_store = self.kv_manager.take_tier_moves()
            result = self.runner.execute(batch)
        except TensorParallelError:  # a dead worker: the engine is dead, not just this step
            raise
        except Exception as e:
            logger.exception("the model step failed; failing the %d requests in it",
                             len(sched.requests))
            self.scheduler.step_failed(sched)
            return outputs + self._fail(sched.requests, f"model step failed: {e}")
        self.num_prompt_tokens_computed += result.num_prompt_tokens
        self.events.prompt_tokens += result.num_prompt_tokens
        sampled = {row.request_id: tok for row, tok in zip(rows, result.token_ids)
                   if tok is not None}  # a verification group answers on its first row
        logprobs = {row.request_id: TokenLogprobs._make(lp)
                    for row, lp in zip(rows, result.logprobs) if lp is not None}
        updated = self.scheduler.update(sched, sampled)
        if self.speculator is not None:
            self.speculator.record(sched, sampled)
        beams = [s for s in updated if s.beam_group is not None]
        if beams:
            updated = [s for s in updated if s.beam_group is None]
            # each advanced beam's grammar takes its token
            finished = advance_beam_groups(beams, logprobs, self.scheduler,
                                           on_advance=self.structured.advance)
            outputs += self._beam_outputs(finished)
        touched = self.output_processor.process(updated, logprobs, self.scheduler.finish)
        self.structured.advance(updated, self.scheduler.finish)  # after the text: keeps its end
        self._record(updated, sampled)
        return outputs + self.output_processor.outputs(touched)

    def _fill_lora_slots(self, sched) -> list[RequestOutput]:
        failed = self.lora.fill_slots(sched.requests, sched.lora_keys_in_use)
        if not failed:
            return []
        dropped = [s for s in sched.requests if s.lora is not None and s.lora.key in failed]
        self.scheduler.drop_from_step(sched, dropped)
        outputs = []
        for key, message in failed.items():
            outputs += self._fail([s for s in dropped if s.lora.key == key], message)
        return outputs

    def _fail(self, seqs: list[Request], message: str) -> list[RequestOutput]:
        """Fail the client requests these sequences belong to, every sequence of each."""
        ids, beam_groups = set(), {}
        for seq in seqs:
            if seq.beam_group is not None:
                beam_groups[seq.client_request_id] = seq.beam_group
                continue
            group = self.output_processor.group_of(seq.client_request_id)
            if group is None:
                continue
            group.error = message
            for s in group.seqs:
                self.scheduler.finish(s, RequestStatus.FINISHED_ERROR)
            ids.add(seq.client_request_id)
        for beam_group in beam_groups.values():
            beam_group.abort(self.scheduler, error=message)
        return self.output_processor.outputs(ids) + self._beam_outputs(
            [g for g in beam_groups.values() if g.request_id in self.beam_groups])

    def _record(self, updated: list[Request], sampled: dict) -> None:
        ev = self.events
        # a sequence that verified proposals got all it accepted in one step
        ev.generation_tokens += sum(
            len(t) if isinstance(t := sampled.get(seq.request_id), list) else 1
            for seq in updated)
        for seq in updated:
            m = seq.metrics
            if seq.num_output_tokens == 1:
                ev.time_to_first_token.append(m.first_token_time - m.arrival_time)
                ev.queue_time.append((m.first_scheduled_time or m.arrival_time) - m.arrival_time)
            elif seq.prev_token_time is not None:
                ev.inter_token_latency.append(m.last_token_time - seq.prev_token_time)
            seq.prev_token_time = m.last_token_time
            if seq.finished:
                ev.e2e_latency.append((m.finished_time or m.last_token_time) - m.arrival_time)
                ev.finished_reasons.append(seq.finish_reason)

    # --- observability -------------------------------------------------------------------
    def drain_events(self) -> StepEvents:
        ev, self.events = self.events, StepEvents()
        self.structured.record(ev)
        if self.speculator is not None:
            c = self.speculator.drain()
            ev.spec_drafts, ev.spec_draft_tokens = c.num_drafts, c.num_draft_tokens
            ev.spec_accepted_tokens = c.num_accepted_tokens
            ev.spec_accepted_per_position = c.accepted_per_position
        return ev

    def snapshot(self) -> EngineSnapshot:
        kv, sched = self.kv_manager, self.scheduler
        return EngineSnapshot(
            num_running=sched.num_running_seqs,
            num_waiting=sum(s.num_seqs for s in sched.waiting),
            num_swapped=len(sched.swapped),
            blocks_total=kv.num_blocks,
            blocks_used=kv.num_used_blocks,
            blocks_cached_free=kv.num_cached_free_blocks,
            kv_usage=kv.usage(),
            slack_tokens=self.kv_manager.num_slack_tokens(sched.running),
            host_blocks_total=self.swap_manager.host.num_blocks if self.swap_manager else 0,
            host_blocks_used=self.swap_manager.host.num_used_blocks if self.swap_manager else 0,
            preemptions=dict(sched.num_preemptions),
            prefix_queries=self.kv_manager.prefix_queries,
            prefix_hits=self.kv_manager.prefix_hits,
            kv_tiers=self.kv_tiers.snapshot() if self.kv_tiers is not None else None,
        )


def _in_use(request_id: str) -> QuireValidationError:
    return QuireValidationError("request_id", f"request_id {request_id!r} is already in use",
                                request_id)
