"""The offline API: a list of prompts in, completions out, as fast as the hardware allows."""

from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from quire.config import EngineArgs
from quire.engine.beam_search import BeamSearchParams
from quire.engine.engine import PromptType
from quire.engine.factory import create_engine
from quire.lora.request import LoRARequest
from quire.multimodal.chat import chat_images, image_chat_template, render_image_chat
from quire.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from quire.pooling.params import PoolingParams
from quire.sampling_params import RequestOutputKind, SamplingParams
from quire.validation import QuireValidationError

Message = dict[str, str]


class LLM:
    """`LLM()` loads the default SmolLM2-135M-Instruct; every EngineArgs field is a keyword.
    `LLM(model, runner="pooling")` (or `convert="embed"`, or a base-model checkpoint such as
    a sentence-transformers Qwen3-Embedding folder) embeds instead: `LLM.embed`."""

    def __init__(self, model: str | None = None, **engine_kwargs) -> None:
        self.engine = create_engine(EngineArgs(model=model, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = create_engine(args)
        llm.tokenizer = llm.engine.tokenizer
        return llm

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order (`.outputs.embedding`), on the pooling
        runner. Text prompts get the checkpoint's default prompt first, as
        sentence-transformers' encode() does; `pooling_params.dimensions` cuts a matryoshka
        model's embedding (renormalized)."""
        if getattr(self.engine, "runner_type", "generate") != "pooling":
            raise QuireValidationError(
                "runner", "embed needs the pooling runner: LLM(model, runner='pooling') (or "
                "convert='embed'); this one generates text")
        prompts = _as_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(prompts)
        if len(pooling_params) != len(prompts):
            raise QuireValidationError(
                "pooling_params", f"pooling_params has {len(pooling_params)} entries for "
                f"{len(prompts)} prompts; give one, or one per prompt")
        ids = []
        try:
            for prompt, params in zip(prompts, pooling_params):
                ids.append(self.engine.add_request(None, prompt, params))
        except Exception:
            self.engine.abort_request(ids)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        return [EmbeddingRequestOutput(out.request_id, out.prompt_token_ids,
                                       EmbeddingOutput(out.embedding))
                for out in self._run(ids, use_tqdm)]

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 cache_salt: str | Sequence[str | None] | None = None,
                 priority: int | Sequence[int] | None = None,
                 ) -> list[RequestOutput]:
        """Outputs in input order. `prompts`: a string, a list of token ids, a dict with
        'prompt' or 'prompt_token_ids', or a list of those. `lora_request`: one adapter for
        all prompts, or one (or None: the base model) per prompt. `cache_salt`: likewise one
        string or one per prompt; prompts share prefix-cache blocks only with prompts of the
        same salt (RequestOutput.num_cached_tokens says how many prompt tokens were hits).
        `priority`: one integer, or one per prompt (vLLM's: lower first; it matters under
        scheduling_policy='priority' and is ignored under fcfs)."""
        prompts = _as_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise QuireValidationError(
                "sampling_params", f"sampling_params has {len(sampling_params)} entries for "
                f"{len(prompts)} prompts; give one, or one per prompt")
        loras = _per_prompt(lora_request, LoRARequest, len(prompts), "lora_request")
        salts = _per_prompt(cache_salt, str, len(prompts), "cache_salt")
        priorities = _per_prompt(priority, type(None), len(prompts), "priority") \
            if isinstance(priority, (list, tuple)) else [priority] * len(prompts)
        priorities = [0 if p is None else p for p in priorities]  # checked by add_request
        ids = []
        try:
            for prompt, params, lora, salt, prio in zip(prompts, sampling_params, loras, salts,
                                                        priorities):
                params = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                ids.append(self.engine.add_request(None, prompt, params, lora_request=lora,
                                                   cache_salt=salt, priority=prio))
        except Exception:
            self.engine.abort_request(ids)  # all or nothing: don't leave half a batch queued
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams, use_tqdm: bool = True) -> list[RequestOutput]:
        """The best `beam_width` sequences per prompt, best first (outputs[0] is the best).
        Beams share the KV blocks of their common history."""
        prompts = _as_list(prompts)
        ids = [self.engine.add_beam_search(None, p, params) for p in prompts]
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None,
             tools: list[dict] | None = None,
             cache_salt: str | Sequence[str | None] | None = None,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """One conversation (a list of {'role', 'content'}) or a list of them, through the
        tokenizer's chat template. `tools`: OpenAI function tools the template is given
        (assistant tool_calls and role 'tool' messages render too); parse the replies with
        quire.entrypoints.tool_calls. `cache_salt`: as in generate(). A message's content
        may be a list of parts: text, and images as {'type': 'image_url', 'image_url': {'url':
        'data:image/...;base64,...'}} or {'type': 'image_pil', 'image_pil': PIL image}
        (a vision-language model's; rendered by its processor's chat template).
        `continue_final_message` (with add_generation_prompt False): the prompt ends inside
        the last message, which the answer continues, as vLLM's LLM.chat."""
        if continue_final_message and add_generation_prompt:
            raise QuireValidationError(
                "continue_final_message", "continue_final_message continues the last message, "
                "so add_generation_prompt must be False (it opens a new one)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for c in conversations:
            rendered, images = chat_images(c, self.engine.args.max_image_pixels)
            if images:
                prompts.append(self._image_chat_prompt(rendered, images, add_generation_prompt,
                                                       chat_template, continue_final_message,
                                                       tools))
            else:
                prompts.append({"prompt_token_ids": self.apply_chat_template(
                    c, add_generation_prompt, chat_template, tools, continue_final_message)})
        return self.generate(prompts, sampling_params, use_tqdm, cache_salt=cache_salt)

    def _image_chat_prompt(self, messages: list[dict], images: list,
                           add_generation_prompt: bool, chat_template: str | None,
                           continue_final_message: bool = False,
                           tools: list[dict] | None = None) -> dict:
        """The conversation's text through the processor's template (which places the image
        token per image part), with its images: the prompt dict generate() takes."""
        processor = getattr(self.engine, "mm_processor", None)
        if processor is None:
            raise QuireValidationError(
                "messages", f"the model is not multimodal: "
                f"{self.engine.model_config.architecture} takes text only, so messages can't "
                "carry image parts")
        from quire.entrypoints.tool_calls.render import with_tools  # tool calling
        template = image_chat_template(processor, self.tokenizer, chat_template)
        messages, extra = with_tools(template, messages, tools, {})
        text = render_image_chat(processor, self.tokenizer, messages, add_generation_prompt,
                                 template, continue_final_message=continue_final_message,
                                 **extra)
        # the rendered text has the template's special tokens: the tokenizer adds none
        return {"prompt": text, "multi_modal_data": {"image": images},
                "add_special_tokens": False}

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            chat_template: str | None = None,
                            tools: list[dict] | None = None,
                            continue_final_message: bool = False) -> list[int]:
        if tools or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
            from quire.entrypoints.tool_calls import render_chat_prompt  # tool calling
            return render_chat_prompt(self.tokenizer, messages, tools, chat_template,
                                      add_generation_prompt, continue_final_message)
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise QuireValidationError(
                "chat_template", "this model's tokenizer has no chat template; pass "
                "chat_template")
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=True,
            chat_template=chat_template, return_dict=False)
        return list(ids)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True,
                   disable=not use_tqdm)
        start, prompt_toks, out_toks = time.perf_counter(), 0, 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if not out.finished:
                    continue
                done[out.request_id] = out
                prompt_toks += len(out.prompt_token_ids)
                out_toks += sum(len(c.token_ids) for c in out.outputs)
                elapsed = time.perf_counter() - start
                bar.set_postfix_str(f"input: {prompt_toks / elapsed:.0f} toks/s, "
                                    f"output: {out_toks / elapsed:.0f} toks/s", refresh=False)
                bar.update(1)
        bar.close()
        failed = [done[i] for i in ids if done[i].error]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(ids)} requests failed; the first: "
                               f"{failed[0].error}")
        return [done[i] for i in ids]


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int):
        return [list(prompts)]  # one prompt of token ids
    return list(prompts)


def _per_prompt(value, one: type, n: int, name: str) -> list:
    """A value given once for every prompt, or a list of one per prompt."""
    if value is None or isinstance(value, one):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise QuireValidationError(name, f"{name} has {len(values)} entries for {n} prompts; "
                                   "give one, or one per prompt")
    return values
