"""PoolingEngine: the LLMEngine's pieces (model, KV cache, scheduler, runner) serving
embedding requests. A request is its prompt alone: prefilled in chunks through the same
scheduler and token budget, its last position's final hidden state pooled when its prompt is
done, and its blocks given back at once (no KV kept after). The embedding is then cut to the
request's `dimensions` (matryoshka) and normalized as the checkpoint says."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from quire.config import EngineArgs
from quire.engine.engine import LLMEngine, PromptType
from quire.engine.request import Request, RequestStatus
from quire.lora.request import LoRARequest
from quire.models.loader import resolve_model
from quire.outputs import CompletionOutput, RequestOutput
from quire.pooling.batch import make_pooling_step
from quire.pooling.config import PoolerConfig, load_pooler_config
from quire.pooling.params import PoolingParams
from quire.priorities import check_priority
from quire.sampling_params import SamplingParams
from quire.validation import QuireValidationError

logger = logging.getLogger(__name__)

_PREFILL_ONLY = SamplingParams(temperature=0, max_tokens=1)  # what the scheduler reads


@dataclass
class _PoolingRequest:
    seq: Request
    params: PoolingParams
    prompt: str | None


class PoolingEngine(LLMEngine):
    runner_type = "pooling"

    def __init__(self, args: EngineArgs, serving: bool = False) -> None:
        super().__init__(args, serving)
        source = resolve_model(args.model, args.revision, args.download_dir)
        folder = source.path if source.kind == "hf" and os.path.isdir(source.path) else ""
        self.pooler: PoolerConfig = load_pooler_config(folder, self.model_config.hf)
        self._requests: dict[str, _PoolingRequest] = {}
        logger.info("pooling runner: %s-token pooling, %s, %d dimensions%s",
                    self.pooler.pooling, "normalized" if self.pooler.normalize else "raw",
                    self.pooler.hidden_size,
                    " (matryoshka)" if self.pooler.is_matryoshka else "")

    # --- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: PoolingParams | None = None, arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None,
                    cache_salt: str | None = None, priority: int = 0) -> str:
        """Queue one prompt to embed (priority: as LLMEngine.add_request's)."""
        if isinstance(params, SamplingParams):
            raise QuireValidationError(
                "runner", "this engine runs the pooling runner (embeddings): it can't "
                "generate text; start one with runner 'generate' for that")
        params = params or PoolingParams()
        if not isinstance(params, PoolingParams):
            raise QuireValidationError("pooling_params", f"pooling_params must be a "
                                       f"PoolingParams, got {params!r}")
        if lora_request is not None:
            raise QuireValidationError("lora_request", "the pooling runner serves the base "
                                       "model only (no LoRA adapters)")
        self.pooler.check_dimensions(params.dimensions)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._requests:
            raise QuireValidationError("request_id", f"request_id {request_id!r} is already "
                                       "in use", request_id)
        if isinstance(prompt, str):  # the checkpoint's default prompt, as encode() puts it
            prompt = self.pooler.default_prompt + prompt
        text, token_ids = self._tokenize(prompt)
        self._check_fits(len(token_ids))
        check_priority(priority)
        seq = Request(request_id, token_ids, _PREFILL_ONLY, frozenset(), 1, arrival_time,
                      cache_salt=cache_salt, priority=priority)
        self._requests[request_id] = _PoolingRequest(seq, params, text)
        self.scheduler.add_request(seq)
        return request_id

    def _check_fits(self, num_tokens: int) -> None:
        """The input must fit the context and the KV cache; it may fill them, as nothing is
        generated after it (LLMEngine's check keeps a slot for an answer)."""
        limit = min(self.max_model_len, self.capacity_tokens)
        if num_tokens > limit:
            raise QuireValidationError(
                "prompt", f"prompt is {num_tokens} tokens; this model's context is "
                f"{self.max_model_len} tokens and the KV cache holds {self.capacity_tokens}, "
                f"so inputs may have at most {limit} tokens")

    def abort_request(self, request_ids) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            req = self._requests.pop(rid, None)
            if req is not None:
                self.scheduler.finish(req.seq, RequestStatus.FINISHED_ABORTED)
                self._aborted_outputs.append(self._output(req, None))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._aborted_outputs)

    # --- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule -> execute (chunks that end their prompt pooled) -> pooled outputs."""
        sched = self.scheduler.schedule()
        make_pooling_step(sched)
        result = self._execute(sched)
        outputs, self._aborted_outputs = self._aborted_outputs, []
        outputs += self._fail(sched.failed)
        if result is None or not sched.seq_ids:
            return outputs
        self.num_prompt_tokens_computed += result.num_prompt_tokens
        self.events.prompt_tokens += result.num_prompt_tokens
        self.scheduler.update(sched, {}, {})
        for key, hidden in result.pooled.items():
            req = self._requests.pop(key, None)
            if req is None:
                continue  # aborted while the step ran
            self.scheduler.finish(req.seq, RequestStatus.FINISHED_STOPPED)
            m = req.seq.metrics
            self.events.finished_reasons.append("stop")
            self.events.e2e_latency.append(m.finished_time - m.arrival_time)
            outputs.append(self._output(req, self._embedding(hidden, req.params)))
        return outputs

    def _embedding(self, hidden: torch.Tensor, params: PoolingParams) -> list[float]:
        v = hidden.float()
        if params.dimensions is not None:
            v = v[:params.dimensions]
        normalize = self.pooler.normalize if params.normalize is None else params.normalize
        if normalize:
            v = torch.nn.functional.normalize(v, dim=-1)
        return v.tolist()

    def _fail(self, failed: list[tuple[str, str]]) -> list[RequestOutput]:
        """Fail these requests (id, why)."""
        outputs = []
        for request_id, message in failed:
            req = self._requests.pop(request_id, None)
            if req is None:
                continue
            self.scheduler.finish(req.seq, RequestStatus.FINISHED_ERROR)
            outputs.append(self._output(req, None, message))
        return outputs

    def _output(self, req: _PoolingRequest, embedding: list[float] | None,
                error: str | None = None) -> RequestOutput:
        seq = req.seq
        return RequestOutput(
            request_id=seq.request_id, prompt=req.prompt, prompt_token_ids=seq.prompt_token_ids,
            outputs=[CompletionOutput(0, "", [], finish_reason=seq.finish_reason)],
            finished=True, metrics=seq.metrics, num_cached_tokens=max(seq.num_cached_tokens, 0),
            error=error, embedding=embedding)
