"""Request and response bodies of the HTTP API (OpenAI's shapes plus Quire's extras), and
the errors the server answers with.

Requests are parsed strictly from the raw JSON (no "5" for 5, no 1.5 for an integer, no
Infinity or NaN), and every problem becomes an OpenAIError: HTTP 400 naming the parameter, in
OpenAI's error shape. Ranges are checked once, by SamplingParams and the engine, whose
QuireValidationErrors carry the field; the server's own bounds (list lengths, sizes) are in
limits.py.
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

from quire.engine.block_hash import MAX_CACHE_SALT_CHARS
from quire.entrypoints.errors import OpenAIError, bad_request, invalid_input
from quire.priorities import MAX_PRIORITY, MIN_PRIORITY
from quire.sampling_params import MAX_LOGPROBS, MAX_SEED, RequestOutputKind, SamplingParams
from quire.structured.params import GuidedDecodingParams


# --- parsing --------------------------------------------------------------------------------
class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def parse_request(cls: type[_Request], raw: bytes) -> Any:
    """The body as `cls`, or an OpenAIError (400) naming the first bad parameter."""
    try:
        return cls.model_validate_json(raw or b"")
    except ValidationError as e:
        raise _validation_error(cls, e, raw or b"") from None


# a \uD800-\uDBFF escape not followed by a \uDC00-\uDFFF one, or a \uDC00-\uDFFF alone
_LONE_SURROGATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def _validation_error(cls: type[BaseModel], exc: ValidationError,
                      raw: bytes = b"") -> OpenAIError:
    errors = exc.errors(include_url=False)
    # of the first bad field's errors, the deepest: a union's other branches fail at its top
    # ("input should be a valid string") while the one the client meant says what is wrong
    err = max((e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]),
              key=lambda e: len(e["loc"]))
    kind, loc = err["type"], err["loc"]
    if kind == "json_invalid":
        lone = _LONE_SURROGATE.search(raw)
        if lone is not None:  # the parser's own words ("end of hex escape") mislead
            return bad_request(
                f"the request body is not valid JSON: {lone.group().decode()} at byte "
                f"{lone.start()} is a lone UTF-16 surrogate, not a character (a \\uD800-"
                f"\\uDBFF escape must be followed by a \\uDC00-\\uDFFF one)")
        return bad_request(f"the request body is not valid JSON: {err['msg']}")
    if kind == "model_type" or not loc:
        return bad_request("the request body must be a JSON object")
    param = str(loc[0])
    if kind == "missing" and len(loc) == 1:
        return bad_request(f"'{param}' is required", param)
    if kind == "extra_forbidden":
        allowed = ", ".join(sorted(cls.model_fields))
        return bad_request(f"unknown parameter '{param}'; this endpoint takes {allowed}", param)
    field = cls.model_fields.get(param)
    expected = field.description if field is not None and field.description else None
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:]
                    if isinstance(p, int) or not _is_union_tag(p))
    message = f"invalid '{param}{where}': {err['msg']}"
    if expected:
        message += f" ({param} must be {expected})"
    return bad_request(message, param)


def _is_union_tag(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "list", "dict", "none")


# --- sampling parameters shared by /v1/completions, /v1/chat/completions and /generate -----
class SamplingFields(_Request):
    n: int = 1
    temperature: float | None = Field(None, description="a finite number >= 0")
    top_p: float | None = Field(None, description="a finite number in (0, 1]")
    top_k: int | None = Field(None, description="-1 or 0 (all tokens) or a positive integer")
    min_p: float | None = Field(None, description="a finite number in [0, 1]")
    repetition_penalty: float | None = Field(None, description="a finite number > 0")
    presence_penalty: float | None = Field(None, description="a finite number in [-2, 2]")
    frequency_penalty: float | None = Field(None, description="a finite number in [-2, 2]")
    seed: int | None = Field(None, description=f"an integer in [0, {MAX_SEED}]")
    stop: str | list[str] | None = Field(None, description="a string or a list of strings")
    stop_token_ids: list[int] | None = Field(None, description="a list of token ids")
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None,
                        stream: bool,
                        guided_decoding: GuidedDecodingParams | None = None,
                        renames: dict[str, str] | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams, or OpenAIError 400 naming the parameter that is out of range
        (`renames`: SamplingParams' names this endpoint's request spells otherwise)."""
        # (seed's range is SamplingParams'; n against max_num_seqs is the engine's check)
        values = {k: getattr(self, k) for k in SAMPLING_FIELDS if getattr(self, k) is not None}
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        try:
            return SamplingParams(**values, max_tokens=max_tokens, logprobs=logprobs,
                                  output_kind=kind, guided_decoding=guided_decoding,
                                  prompt_logprobs=prompt_logprobs)
        except ValueError as e:
            raise invalid_input(e, renames) from None


# every field above goes to SamplingParams under its own name (a test holds them to that)
SAMPLING_FIELDS = tuple(SamplingFields.model_fields)


class StreamOptions(_Request):
    include_usage: bool = False


# --- prefix-cache isolation, on /v1/completions, /v1/chat/completions and /generate ------
class CacheSaltField(_Request):
    """vLLM's cache_salt: requests share prefix-cache blocks only with requests of the same
    salt (a tenant's own secret keeps its prompts' KV from other tenants)."""
    cache_salt: str | None = Field(
        None, min_length=1, max_length=MAX_CACHE_SALT_CHARS,
        description=f"a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")


# --- scheduling priority, on /v1/completions, /v1/chat/completions and /generate ----------
class PriorityField(_Request):
    """vLLM's priority: lower is served first under --scheduling-policy priority (accepted
    and ignored under fcfs)."""
    priority: int = Field(0, ge=MIN_PRIORITY, le=MAX_PRIORITY,
                          description=f"an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}]")


# --- token ids for request migration (the router), on /v1/completions and chat -------------
class TokenIdFields(_Request):
    """`return_token_ids` (vLLM's name): each streamed choice chunk also carries the ids of
    the tokens whose text it brings (`token_ids`; the first also `prompt_token_ids`).
    `continue_token_ids` (Quire's): tokens of this answer already generated elsewhere (a
    replica that died mid-stream); they follow the prompt and the stream goes on after
    them, so the continuation is exactly what one uninterrupted run gives (greedy). The
    router sends it with max_tokens already reduced; it needs n == 1 and one prompt."""
    return_token_ids: bool = False
    continue_token_ids: list[int] | None = Field(None, description="a list of token ids")


# --- structured output, on /v1/completions and /v1/chat/completions -----------------------
class StructuredOutputFields(_Request):
    """OpenAI's response_format and vLLM's extra-body spellings; request_formats.py checks
    their shapes (a 400 naming the field) when it builds the GuidedDecodingParams."""
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None
    disable_any_whitespace: bool | None = None

    def structured_output_fields(self) -> dict:
        """The fields that were given, as request_formats.guided_decoding_from_request
        takes them."""
        return {k: getattr(self, k) for k in STRUCTURED_OUTPUT_FIELDS
                if getattr(self, k) is not None}


STRUCTURED_OUTPUT_FIELDS = tuple(StructuredOutputFields.model_fields)


# --- /v1/completions ------------------------------------------------------------------------
class TruncateField(_Request):
    """vLLM's truncate_prompt_tokens: keep the prompt's last this many tokens (-1: as many as
    the context takes)."""
    truncate_prompt_tokens: int | None = Field(
        None, description="-1 or a positive integer (the prompt's last this many tokens)")

    def checked_truncation(self) -> int | None:
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not (k == -1 or k >= 1)):
            raise bad_request(f"truncate_prompt_tokens must be -1 or a positive integer, got "
                              f"{k!r}", "truncate_prompt_tokens")
        return k


class CompletionRequest(SamplingFields, StructuredOutputFields, CacheSaltField, PriorityField,
                        TokenIdFields, TruncateField):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, a list of token ids or a list of lists of "
                    "token ids")
    max_tokens: int | None = 16  # 0 only with echo: the prompt scored, nothing generated
    logprobs: int | None = Field(None, description=f"an integer in [0, {MAX_LOGPROBS}] or null")
    # vLLM's extra: each prompt token's logprob and top-k (choices[].prompt_logprobs)
    prompt_logprobs: int | None = Field(
        None, description=f"an integer in [0, {MAX_LOGPROBS}] or null")
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    user: str | None = None


# --- /v1/chat/completions -------------------------------------------------------------------
class ImageURL(_Request):
    url: str = Field(description="a data:image/...;base64 URL, or an http(s) URL where the "
                                 "server allows fetching")
    detail: str | None = None  # OpenAI's auto/low/high: the model's processor decides


class ContentPart(_Request):
    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None  # a 'image_url' part's (a string: vLLM's form)


class FunctionCallIn(_Request):
    name: str
    arguments: str | dict = "{}"


class ToolCallIn(_Request):
    """A call an earlier assistant message made (sent back with the conversation)."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = Field(
        None, description="a string or a list of {'type': 'text', 'text': ...} parts")
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None   # an assistant's calls
    tool_call_id: str | None = None              # a tool message: the call it answers

    def as_template_message(self, image_parts: bool = False) -> dict:
        """image_parts: keep the parts, images as {"type": "image"} (what a processor's chat
        template places its image placeholder for); else the text parts joined."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if image_parts and part.type == "image_url":
                    texts.append({"type": "image"})
                    continue
                if part.type == "text" and part.text is None:
                    raise bad_request("a content part of type 'text' needs its 'text' (a "
                                      "string)", "messages")
                if part.type != "text":
                    allowed = "'text' and 'image_url'" if image_parts else "only 'text'"
                    raise bad_request(f"content parts of type {part.type!r} are not supported; "
                                      f"{allowed} parts", "messages")
                texts.append({"type": "text", "text": part.text} if image_parts else part.text)
            content = texts if image_parts else "\n".join(texts)
        msg = {"role": self.role, "content": content if content is not None else ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg

    def num_chars(self) -> int:
        if isinstance(self.content, list):
            n = sum(len(p.text or "") for p in self.content)
        else:
            n = len(self.content or "")
        for call in self.tool_calls or ():
            args = call.function.arguments
            n += len(call.function.name) + (len(args) if isinstance(args, str) else
                                             len(str(args)))
        return n + len(self.name or "") + len(self.tool_call_id or "")


class ChatCompletionRequest(SamplingFields, StructuredOutputFields, CacheSaltField, PriorityField,
                            TokenIdFields, TruncateField):
    model: str | None = None
    messages: list[ChatMessage] = Field(
        description="a non-empty list of {'role', 'content'} messages")
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, description=f"an integer in [0, {MAX_LOGPROBS}] or null")
    # vLLM's extra: each prompt token's logprob and top-k (the response's prompt_logprobs)
    prompt_logprobs: int | None = Field(
        None, description=f"an integer in [0, {MAX_LOGPROBS}] or null")
    stream: bool = False
    stream_options: StreamOptions | None = None
    add_generation_prompt: bool = True
    # vLLM's: the prompt ends inside the last message (no end of turn), which the answer
    # continues; needs add_generation_prompt false
    continue_final_message: bool = False
    # vLLM's: the answer's content starts with the last message's, when that is the
    # assistant's (with continue_final_message: the whole message, not just its new end)
    echo: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = Field(
        None, description="a JSON object of extra chat template variables, as "
                          "{'enable_thinking': false}")
    logit_bias: dict[str, float] | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = Field(
        None, description="'none', 'auto', 'required' or {'type': 'function', 'function': "
                          "{'name': ...}}")
    parallel_tool_calls: bool = True
    user: str | None = None


# --- /generate (vLLM's simple API) ----------------------------------------------------------
class GenerateRequest(SamplingFields, CacheSaltField, PriorityField):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)  # no extras
    model: str | None = None
    prompt: str | list[int] = Field(description="a string or a list of token ids")
    stream: bool = False
    max_tokens: int | None = 16
    logprobs: int | None = None


# --- /tokenize, /detokenize -----------------------------------------------------------------
class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False  # vLLM's: each token's string too (token_strs)
    chat_template_kwargs: dict | None = Field(
        None, description="a JSON object of extra chat template variables")


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int] = Field(description="a list of token ids")


# --- responses ------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int,
           cached_tokens: int | None = None) -> UsageInfo:
        details = None if cached_tokens is None else PromptTokensDetails(
            cached_tokens=cached_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=details)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class LogprobOut(BaseModel):
    """vLLM's Logprob, as prompt_logprobs carry it (keyed by token id)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one entry per prompt token, the first null: token id -> its Logprob
PromptLogprobsOut = list[dict[int, LogprobOut] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsOut | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: the <think> part
    tool_calls: list[ToolCallOut] = []


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobsOut | None = None


# --- stream chunks -------------------------------------------------------------------------
class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class _Sparse(BaseModel):
    @model_serializer(mode="wrap")
    def _omit_missing(self, handler):  # a delta holds only what it carries
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_Sparse):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Sparse):
    """A piece of a streamed call: index, id, type and name first, then argument pieces."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatDelta(_Sparse):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorChunk(BaseModel):
    """An error in the middle of a stream (the status line has long been sent)."""
    error: ErrorInfo

    @classmethod
    def of(cls, e: OpenAIError) -> ErrorChunk:
        return cls(error=ErrorInfo(**e.body()["error"]))


def sse(chunk: BaseModel) -> str:
    """One server-sent event."""
    return f"data: {chunk.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"
