"""LLMEngine: add_request, abort_request, step.

A step is three calls, as in vLLM v1: the scheduler decides (with every per-request feature's
part: grammars, proposals, adapter slots, beams) and hands out plain data; the executor runs
it (model, KV tensors, sampler, draft model, TP workers); the update gives the sampled tokens
back to the scheduler, then text, stops and outputs.

Names: `kv_manager` is the KVCacheManager (block tables), the executor's `kv_cache` the KV
tensors; a client request becomes one or more sequences (`Request` objects), its sibling
group; a beam search becomes a beam group (engine/beam_search.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence

from quire.config import EngineArgs
from quire.cpu_threads import configure_threads
from quire.distributed.errors import TensorParallelError
from quire.engine.beam_search import (
    BeamSearchGroup,
    BeamSearchParams,
    num_blocks_for_beam_search,
)
from quire.engine.block_hash import check_cache_salt
from quire.engine.block_pool import BlockPool
from quire.engine.features.beam_search import BeamSearch
from quire.engine.features.lora_slots import LoRASlots
from quire.engine.features.speculation import Speculation
from quire.engine.features.structured_output import StructuredOutput
from quire.engine.kv_cache_manager import KVCacheManager
from quire.engine.output_processor import OutputProcessor
from quire.engine.request import Request, RequestStatus
from quire.engine.sched_policy import counts_by_band
from quire.engine.scheduler import Scheduler
from quire.engine.scheduler_output import SchedulerOutput
from quire.engine.stats import EngineSnapshot, StepEvents
from quire.engine.swap_manager import SwapManager
from quire.executor import Executor, StepResult
from quire.kv_tiers.setup import build_kv_tiers
from quire.lora.adapters import EngineAdapters
from quire.lora.request import LoRARequest
from quire.models.config import ModelConfig
from quire.models.loader import load_hf_config, load_tokenizer, materialize, resolve_model
from quire.multimodal.image_attention import longest_run
from quire.multimodal.images import as_images
from quire.multimodal.inputs import ProcessedPrompt
from quire.multimodal.limits import check_image_count
from quire.multimodal.processor import FIELD as MM_FIELD
from quire.multimodal.processor import MultiModalProcessor
from quire.outputs import RequestOutput, TokenLogprobs
from quire.platform import default_step_budget, resolve_device, resolve_dtype
from quire.priorities import check_priority
from quire.sampling_params import MAX_SEED, SamplingParams
from quire.spec_decode.draft import DraftProposer
from quire.validation import QuireValidationError, check_int

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
        # a vision-language model's processor step (None: the model takes text only)
        self.mm_processor = None
        if cfg.multimodal_hf is not None:
            self._check_multimodal_args(args)
            self.mm_processor = MultiModalProcessor.of(source.path, cfg.multimodal_hf)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.max_model_len = self._max_model_len(cfg)
        self.block_size = args.block_size
        self.executor = Executor(args, source, cfg, self.dtype, self.device,
                                 self.max_model_len)
        self.kv_dtype = self.executor.kv_dtype
        self.attention_backend = self.executor.attention_backend

        pool = BlockPool(self.executor.num_blocks, args.enable_prefix_caching)
        # KV tiers under the pool and KV-cache events, each None when off: the tiers file
        # the blocks the executor copies out, and hand back those a prefix hit loads
        self.kv_tiers, self.kv_events = build_kv_tiers(
            args, model_path=source.path, dtype=self.dtype, kv_dtype=self.kv_dtype,
            num_layers=cfg.num_layers, num_kv_heads=self.executor.model.num_kv_heads_per_rank,
            head_dim=cfg.head_dim)
        if self.kv_tiers is not None:
            self.executor.kv_cache.tier_sink = self.kv_tiers.store
        self.kv_manager = KVCacheManager(pool, self.block_size, self.kv_tiers, self.kv_events)
        self.swap_manager = (SwapManager(self.kv_manager, self.executor.num_host_blocks)
                             if self.executor.host_cache is not None else None)
        self.eos_token_ids = self._eos_token_ids(cfg)
        # the per-request features, in the order the scheduler calls them
        self.structured = StructuredOutput(self.tokenizer, cfg.vocab_size, self.eos_token_ids)
        self.lora = None  # LoRA adapters: registry, the executor's slots, the admission rule
        features = [self.structured]
        if args.enable_lora:
            self.lora = EngineAdapters(args, self.executor.lora_manager)
            features.append(LoRASlots(self.lora))
        self.speculator = self._speculation()  # speculative decoding, when configured
        if self.speculator is not None:
            features.append(self.speculator)
        self.beams = BeamSearch(self.structured)
        features.append(self.beams)
        # Gemma 3: each image's run attends both ways, so it is computed in one chunk
        self.whole_image_runs = bool(getattr(self.executor.model, "mm_bidirectional", False))
        if self.whole_image_runs:
            self._check_image_budget(cfg, args)
        self.scheduler = Scheduler(self.kv_manager, args.max_num_seqs,
                                   args.max_num_batched_tokens, self.swap_manager,
                                   self._rope_switch_length(), features,
                                   args.scheduling_policy, self.whole_image_runs)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.events = StepEvents()
        self.num_prompt_tokens_computed = 0  # lifetime, for tests and benchmarks
        self._aborted_outputs: list[RequestOutput] = []
        self._prev_token_time: dict[str, float] = {}  # sequence id -> for inter-token latency
        self._ids = itertools.count()
        logger.info("loaded %s (%s, %s, attention %s, %d tokens per step) in %.1fs",
                    self.model_name, cfg.architecture, str(self.dtype).removeprefix("torch."),
                    self.attention_backend, args.max_num_batched_tokens,
                    time.perf_counter() - t0)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op at size 1); safe to call twice."""
        self.executor.shutdown()
        if self.kv_tiers is not None:
            self.executor.kv_cache.flush_offloads()
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

    @staticmethod
    def _check_multimodal_args(args: EngineArgs) -> None:
        """What a vision-language model can't run with yet, refused before anything starts."""
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(args, name) != 1:
                raise QuireValidationError(
                    name, f"{name} must be 1 for a multimodal model (the image encoder runs "
                    f"in the engine's process, not yet sharded), got {getattr(args, name)}",
                    getattr(args, name))

    @staticmethod
    def _check_image_budget(cfg: ModelConfig, args: EngineArgs) -> None:
        """An image's run must fit one step (it attends both ways): refused at start-up
        when the config says every image's size (Gemma 3's mm_tokens_per_image)."""
        size = getattr(cfg.multimodal_hf, "mm_tokens_per_image", None)
        if size and size > args.max_num_batched_tokens:
            raise QuireValidationError(
                "max_num_batched_tokens", f"max_num_batched_tokens must be >= {size} for "
                f"{cfg.architecture}: each image's {size} tokens attend to one another both "
                "ways and are computed in one step, got "
                f"{args.max_num_batched_tokens}", args.max_num_batched_tokens)

    def _speculation(self) -> Speculation | None:
        config = self.args.speculative  # parsed once, with the other args
        if config is None:
            return None
        draft = None
        if config.method == "draft_model":
            draft = DraftProposer(self.executor.build_draft_model(config, self.tokenizer,
                                                                  self.dtype))
        logger.info("speculative decoding: %s, %d tokens per step", config.method,
                    config.num_speculative_tokens)
        return Speculation(config, self._rope_switch_length(), draft, self.structured)

    def _rope_switch_length(self) -> int | None:
        """LongRoPE's switch (Phi-3): sequences of this many tokens use the long table."""
        threshold = self.executor.model.rope.long_threshold
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
                    cache_salt: str | None = None, priority: int = 0) -> str:
        """Validate and queue one request; raises QuireValidationError naming the field.
        priority: lower is served first under scheduling_policy='priority' (ignored under
        fcfs); an integer in [MIN_PRIORITY, MAX_PRIORITY] (quire/priorities.py).
        lora_request: the adapter it runs with (read on first use); None: the base model.
        cache_salt: requests share prefix-cache blocks only with requests of the same salt
        (None shares with None)."""
        params = params or SamplingParams()
        check_cache_salt(cache_salt)
        check_priority(priority)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if self._in_use(request_id):
            raise _in_use(request_id)
        if params.n > self.args.max_num_seqs:
            raise QuireValidationError(
                "n", f"n must be <= {self.args.max_num_seqs} (this engine's max_num_seqs, "
                f"--max-num-seqs): the n samples run side by side; got {params.n}", params.n)
        text, token_ids, mm = self._process(prompt)
        max_tokens = self._max_tokens(len(token_ids), params)
        if mm is not None and self.whole_image_runs:
            self._check_image_runs(mm)
        # the adapter salts its prefix-cache hashes (KVCacheManager.extra_keys), so no two
        # adapters (nor base and adapter) share KV blocks
        adapter = None if lora_request is None else self._adapters().resolve(lora_request)
        seqs = []
        for i in range(params.n):  # sample i draws with seed + i: one single run reproduces it
            seq_params = params if params.n == 1 else params.clone(
                n=1, seed=None if params.seed is None else (params.seed + i) % (MAX_SEED + 1))
            seqs.append(Request(
                request_id if params.n == 1 else f"{request_id}#{i}", token_ids, seq_params,
                self.eos_token_ids, max_tokens, arrival_time, client_request_id=request_id,
                sample_index=i, lora=adapter, cache_salt=cache_salt, priority=priority,
                images=mm.images if mm else (), mrope=mm.positions if mm else None))
        if params.guided_decoding is not None:  # compiles off this thread; waits till then
            self.structured.attach(seqs, params.guided_decoding)
        if mm is not None:  # the pixels wait with the executor until the request ends
            self.executor.add_images(request_id, mm.pixels)
        self.output_processor.add(request_id, text, token_ids, params, seqs)
        self.scheduler.add_request(seqs[0], seqs[1:])
        return request_id

    def _check_image_runs(self, mm: ProcessedPrompt) -> None:
        """Each image's run is computed in one step: it must fit the step's token budget."""
        longest, budget = longest_run(mm.images), self.args.max_num_batched_tokens
        if longest > budget:
            raise QuireValidationError(
                MM_FIELD, f"an image of the prompt takes {longest} tokens, which attend to one "
                f"another both ways and are computed in one step, but max_num_batched_tokens "
                f"is {budget}; raise max_num_batched_tokens to at least {longest}")

    def _process(self, prompt: PromptType
                 ) -> tuple[str | None, list[int], ProcessedPrompt | None]:
        """Text and token ids, and a prompt with images through the processor step: a dict
        {'prompt': str, 'multi_modal_data': {'image': PIL image or list}} (vLLM's; an
        'add_special_tokens': False key leaves out the tokenizer's BOS, for rendered chats)."""
        if isinstance(prompt, ProcessedPrompt):  # the server's, processed off this thread
            return self._processed(prompt)
        if not isinstance(prompt, dict) or prompt.get(MM_FIELD) is None:
            return (*self._tokenize(prompt), None)
        if self.mm_processor is None:
            raise QuireValidationError(
                MM_FIELD, f"the model is not multimodal: {self.model_config.architecture} "
                f"takes text only, so a prompt can't carry {MM_FIELD}")
        data, text = prompt[MM_FIELD], prompt.get("prompt")
        if not isinstance(data, dict) or set(data) != {"image"}:
            shown = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise QuireValidationError(
                MM_FIELD, f"{MM_FIELD} must be a dict with the one key 'image' (a PIL image or "
                f"a list of them), got {shown}")
        if not isinstance(text, str) or not text:
            raise QuireValidationError(
                "prompt", f"a prompt with {MM_FIELD} needs its text as a non-empty string "
                "'prompt', with one image placeholder per image")
        images = as_images(data["image"], MM_FIELD, self.args.max_image_pixels)
        check_image_count(len(images), self.args.mm_limits["image"], MM_FIELD)
        mm = self.mm_processor.process(text, images, prompt.get("add_special_tokens", True))
        return text, mm.token_ids, mm

    def _processed(self, mm: ProcessedPrompt) -> tuple[None, list[int], ProcessedPrompt]:
        """A prompt the server ran through this engine's processor itself (its images
        checked against the same limits); the ids are still checked as any prompt's."""
        if self.mm_processor is None and mm.images:
            raise QuireValidationError(
                MM_FIELD, f"the model is not multimodal: {self.model_config.architecture} "
                "takes text only")
        check_image_count(len(mm.images), self.args.mm_limits["image"], MM_FIELD)
        _, ids = self._tokenize(mm.token_ids)
        return None, ids, mm

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if prompt.get(MM_FIELD) is not None:
                raise QuireValidationError(MM_FIELD, f"{MM_FIELD} is not supported here (beam "
                                           "search and pooling take text prompts)")
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
        if self._in_use(request_id):
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
                       params.max_tokens, arrival_time, client_request_id=request_id,
                       lockstep_group=request_id)
        if params.guided_decoding is not None:
            self.structured.attach([root], params.guided_decoding)
        self.beams.add(BeamSearchGroup(request_id, text, root, params, self.eos_token_ids,
                                       on_fork=self.structured.fork))
        self.scheduler.add_request(root)
        return request_id

    def _in_use(self, request_id: str) -> bool:
        return (request_id in self.beams.groups
                or self.output_processor.group_of(request_id) is not None)

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            if self.beams.end(rid, self.scheduler):
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
        """Schedule -> execute -> update."""
        sched = self.scheduler.schedule()  # with every feature's part, as plain data
        result = self._execute(sched)      # the executor's one forward (None: it failed)
        outputs = self._update(sched, result)
        if self.mm_processor is not None:  # a finished request's images' pixels may go
            for out in outputs:
                if out.finished:
                    self.executor.release_images(out.request_id)
        return outputs

    def _execute(self, sched: SchedulerOutput) -> StepResult | None:
        try:
            return self.executor.execute(sched)
        except TensorParallelError:  # a dead worker: the engine is dead, not just this step
            raise
        except Exception as e:
            logger.exception("the model step failed; failing the %d sequences in it",
                             len(sched.seq_ids))
            self.scheduler.step_failed(sched)
            sched.failed += [(self._client_id(rid), f"model step failed: {e}")
                             for rid in sched.seq_ids]
            return None

    def _update(self, sched: SchedulerOutput, result: StepResult | None
                ) -> list[RequestOutput]:
        outputs, self._aborted_outputs = self._aborted_outputs, []
        outputs += self._fail(sched.failed)
        for rid in sched.finished_ids:
            self._prev_token_time.pop(rid, None)
        if result is None or not sched.seq_ids:
            return outputs
        self.num_prompt_tokens_computed += result.num_prompt_tokens
        self.output_processor.add_prompt_logprobs(result.prompt_logprobs)
        self.events.prompt_tokens += result.num_prompt_tokens
        rows = sched.row_seq_ids
        sampled = {rid: tok for rid, tok in zip(rows, result.token_ids)
                   if tok is not None}  # a verification group answers on its first row
        logprobs = {rid: TokenLogprobs._make(lp)
                    for rid, lp in zip(rows, result.logprobs) if lp is not None}
        updated = self.scheduler.update(sched, sampled, logprobs)  # beams take theirs
        outputs += [g.output(self.tokenizer) for g in self.beams.pop_finished()]
        touched = self.output_processor.process(updated, logprobs, self.scheduler.finish)
        self.scheduler.after_output(updated)  # grammars take the tokens after the text
        self._record(updated, sampled)
        return outputs + self.output_processor.outputs(touched)

    def _client_id(self, seq_id: str) -> str:
        seq = self.scheduler.sequence(seq_id)
        return seq_id if seq is None else seq.client_request_id

    def _fail(self, failed: list[tuple[str, str]]) -> list[RequestOutput]:
        """Fail these client requests (id, why), every sequence of each."""
        ids = set()
        for client_id, message in failed:
            if client_id in ids:
                continue
            if self.beams.end(client_id, self.scheduler, error=message):
                continue
            group = self.output_processor.group_of(client_id)
            if group is None:
                continue
            group.error = message
            for s in group.seqs:
                self.scheduler.finish(s, RequestStatus.FINISHED_ERROR)
            ids.add(client_id)
        beams = [g.output(self.tokenizer) for g in self.beams.pop_finished()]
        return self.output_processor.outputs(ids) + beams

    def _record(self, updated: list[Request], sampled: dict) -> None:
        ev = self.events
        # a sequence that verified proposals got all it accepted in one step
        ev.generation_tokens += sum(
            len(t) if isinstance(t := sampled.get(seq.request_id), list) else 1
            for seq in updated)
        for seq in updated:
            m = seq.metrics
            prev = self._prev_token_time.get(seq.request_id)
            if seq.num_output_tokens == 1:
                ev.time_to_first_token.append(m.first_token_time - m.arrival_time)
                ev.queue_time.append((m.first_scheduled_time or m.arrival_time) - m.arrival_time)
            elif prev is not None:
                ev.inter_token_latency.append(m.last_token_time - prev)
            self._prev_token_time[seq.request_id] = m.last_token_time
            if seq.finished:
                self._prev_token_time.pop(seq.request_id, None)
                ev.e2e_latency.append((m.finished_time or m.last_token_time) - m.arrival_time)
                ev.finished_reasons.append(seq.finish_reason)

    # --- observability -------------------------------------------------------------------
    def drain_events(self) -> StepEvents:
        ev, self.events = self.events, StepEvents()
        for f in self.scheduler.features:
            f.record(ev)
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
            waiting_by_priority=counts_by_band(sched.waiting),
            running_by_priority=counts_by_band(sched.running),
            kv_tiers=self.kv_tiers.snapshot() if self.kv_tiers is not None else None,
            encoder_cache=self._encoder_cache_counts(),
        )

    def _encoder_cache_counts(self) -> dict[str, int] | None:
        mm = self.executor.multimodal
        if mm is None:
            return None
        return {"hits": mm.cache.hits, "misses": mm.cache.misses, "entries": len(mm.cache),
                "bytes": mm.cache.num_bytes, "images": mm.images_encoded,
                "seconds": mm.encoder_seconds}


def _in_use(request_id: str) -> QuireValidationError:
    return QuireValidationError("request_id", f"request_id {request_id!r} is already in use",
                                request_id)
