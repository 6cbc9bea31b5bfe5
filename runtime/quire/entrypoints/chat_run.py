"""One chat generation, whichever API asked for it: /v1/chat/completions, and the Responses and
Anthropic Messages APIs, which translate their requests into a ChatCompletionRequest and their
answers out of the same parts. So every chat feature (the chat template, tools and tool_choice
grammars, reasoning parsers, structured output, the request limits, cache_salt, LoRA by
`model`, metrics and traces) is one code path.

    run = await start_chat(serving, req, request_id)     # checked, rendered, submitted
    parts = answer_parts(run, completion)                # a whole answer's pieces
    async for piece in stream_pieces(run, tally): ...    # a streamed answer's deltas (n = 1)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from quire.engine.async_engine import RequestStream
from quire.entrypoints.chat_continuation import check_continuation
from quire.entrypoints.chat_media import image_chat_prompt, image_parts
from quire.entrypoints.chat_reasoning import (
    ReasoningDeltas,
    ReasoningUse,
    reasoning_use,
    split_answer,
)
from quire.entrypoints.chat_tools import ToolCallDeltas, ToolUse, message_parts, tool_use
from quire.entrypoints.continuation import continued_prompts
from quire.entrypoints.errors import bad_request
from quire.entrypoints.limits import check_chat_template, check_stop
from quire.entrypoints.logprobs import chat_logprobs
from quire.entrypoints.openai_protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatStreamChoice,
    ToolCallOut,
    UsageInfo,
)
from quire.entrypoints.streaming import merge
from quire.entrypoints.structured_output import guided_decoding
from quire.outputs import CompletionOutput, RequestOutput
from quire.sampling_params import SamplingParams


@dataclass
class ChatRun:
    """A chat request the engine has accepted."""
    request_id: str
    model: str                  # the name the client asked for (an adapter's or the base's)
    params: SamplingParams
    tools: ToolUse
    reasoning: ReasoningUse
    streams: list[RequestStream]
    prompt: list[int]


async def start_chat(serving, req: ChatCompletionRequest, request_id: str,
                     priority: int | None = None) -> ChatRun:
    """Checks the request, renders its prompt and submits it; OpenAIErrors (400 naming the
    chat field, 404 for an unknown model, 503) for anything refused."""
    info, lora = serving.model_for(req.model, runner="generate")
    model = lora.name if lora else req.model or info.served_name  # the name asked for
    check_chat_request(req, serving.limits, info.vocab_size)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    renames = {"prompt": "messages", "logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        renames["max_tokens"] = "max_completion_tokens"
    template = serving.chat_template(req.chat_template)
    tools = await tool_use(serving, req, template)
    guided = await guided_decoding(serving, req)
    if tools.guided is not None and guided is not None:
        raise bad_request("tool_choice 'required' or a named function constrains the answer "
                          "already; it can't be combined with response_format or guided_* "
                          "fields", "tool_choice")
    params = req.sampling_params(max_tokens=max_tokens, logprobs=logprobs,
                                 stream=req.stream,
                                 guided_decoding=tools.guided or guided, renames=renames,
                                 prompt_logprobs=req.prompt_logprobs)
    images = None  # a vision-language model's chat with image parts: processed here
    if image_parts(req.messages):
        check_chat_template(req.chat_template, serving.limits)
        images = await image_chat_prompt(serving, req.messages, req.add_generation_prompt,
                                         info, req.chat_template, tools.tools,
                                         req.chat_template_kwargs, req.continue_final_message)
        prompt = images.token_ids
    else:
        prompt = await serving.chat_prompt_ids(req.messages, req.add_generation_prompt, info,
                                               req.chat_template, tools=tools.tools,
                                               template_kwargs=req.chat_template_kwargs,
                                               continue_final_message=req.continue_final_message)
    prompt = continued_prompts([prompt], req)[0]  # a migrated request goes on where it was
    reasoning = await reasoning_use(serving, req, prompt, params.guided_decoding is not None)
    if reasoning.parser is not None and reasoning.parser.needs_special_tokens:
        params.skip_special_tokens = False  # its markers (harmony's) are special tokens
    submitted = prompt if images is None else dataclasses.replace(images, token_ids=prompt)
    streams = await serving.submit(request_id, [submitted], params, renames, lora,
                                   cache_salt=req.cache_salt, priority=priority)
    return ChatRun(request_id, model, params, tools, reasoning, streams, prompt)


def check_chat_request(req: ChatCompletionRequest, limits, vocab_size: int) -> None:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true",
                          "stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs are not available when stream is true",
                          "prompt_logprobs")
    check_stop(req.stop, req.stop_token_ids, limits, vocab_size)
    check_continuation(req.add_generation_prompt, req.continue_final_message, req.messages)
    if req.checked_truncation() is not None:
        raise bad_request("truncate_prompt_tokens is not supported on chat here (a rendered "
                          "conversation cut at a token count loses its start): shorten the "
                          "messages", "truncate_prompt_tokens")


def echoed(req: ChatCompletionRequest) -> str:
    """What `echo` puts before the answer: the last message's text when it is the
    assistant's (the answer's role), as vLLM does; else nothing."""
    if not req.echo or not req.messages or req.messages[-1].role != "assistant":
        return ""
    content = req.messages[-1].content
    if isinstance(content, list):
        return "\n".join(p.text for p in content if p.type == "text" and p.text is not None)
    return content or ""


# --- whole answers ----------------------------------------------------------------------
@dataclass
class AnswerParts:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCallOut]
    finish_reason: str | None      # "tool_calls" when the answer called tools
    stop_reason: int | str | None  # the stop string or token id that ended it, if one did
    logprobs: ChatLogprobs | None


def answer_parts(run: ChatRun, c: CompletionOutput) -> AnswerParts:
    thought, content = split_answer(run.reasoning, c.text)
    content, tool_calls, finish_reason = message_parts(run.tools, content, c.finish_reason)
    return AnswerParts(thought, content, tool_calls, finish_reason, c.stop_reason,
                       chat_logprobs(c, run.params.logprobs))


# --- streamed answers -------------------------------------------------------------------
class ChatChunks:
    """The ChunkFormat of chat streams: the role first, then content deltas (and, with a
    reasoning parser, delta.reasoning_content pieces; when the answer is read for tool calls,
    delta.tool_calls pieces from its content)."""

    generates = True

    def __init__(self, request_id: str, model: str, params: SamplingParams,
                 tools: ToolUse, reasoning: ReasoningUse | None = None,
                 echo: str = "") -> None:
        self.head = {"id": request_id, "created": int(time.time()), "model": model}
        self.params, self.echo = params, echo
        self.tool_calls = ToolCallDeltas(tools.parser) if tools.parser is not None else None
        self.reasoning = ReasoningDeltas(reasoning) if reasoning is not None and \
            reasoning.parser is not None else None

    def opening(self) -> list[ChatCompletionChunk]:
        chunks = [ChatCompletionChunk(**self.head, choices=[ChatStreamChoice(
            index=i, delta=ChatDelta(role="assistant", content=""))])
            for i in range(self.params.n)]
        if self.echo:
            chunks += [ChatCompletionChunk(**self.head, choices=[ChatStreamChoice(
                index=i, delta=ChatDelta(content=self.echo))]) for i in range(self.params.n)]
        return chunks

    def choice(self, index: int, prompt_index: int, out: RequestOutput,
               c: CompletionOutput) -> ChatCompletionChunk | None:
        lps = chat_logprobs(c, self.params.logprobs)
        thought, text = None, c.text
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(index, c.text, c.finish_reason is not None)
        content, calls, finish_reason = text or None, None, c.finish_reason
        if self.tool_calls is not None:
            content, calls, finish_reason = self.tool_calls.feed(index, text, finish_reason)
        if not content and not thought and not calls and lps is None and finish_reason is None:
            return None
        return ChatCompletionChunk(**self.head, choices=[ChatStreamChoice(
            index=index, delta=ChatDelta(content=content, reasoning_content=thought,
                                         tool_calls=calls), logprobs=lps,
            finish_reason=finish_reason, stop_reason=c.stop_reason)])

    def usage(self, usage: UsageInfo) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.head, choices=[], usage=usage)


@dataclass
class StreamTally:
    """What a streamed answer used so far (its usage once the stream ends)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def usage(self) -> UsageInfo:
        return UsageInfo.of(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


async def stream_pieces(run: ChatRun, tally: StreamTally) -> AsyncIterator[ChatStreamChoice]:
    """The one answer's deltas (content, reasoning, tool-call pieces, logprobs) as chat's
    stream has them; the last one carries the finish_reason. Engine failures are raised
    (RequestFailed, EngineDeadError) for the caller's error event."""
    fmt = ChatChunks(run.request_id, run.model, run.params, run.tools, run.reasoning)
    async for _, out in merge(run.streams):
        tally.prompt_tokens = len(out.prompt_token_ids)
        tally.cached_tokens = out.num_cached_tokens
        for c in out.outputs:
            tally.completion_tokens += len(c.token_ids)
            chunk = fmt.choice(c.index, 0, out, c)
            if chunk is None:
                continue
            piece = chunk.choices[0]
            if piece.finish_reason is not None:
                tally.finish_reason, tally.stop_reason = piece.finish_reason, piece.stop_reason
            yield piece
