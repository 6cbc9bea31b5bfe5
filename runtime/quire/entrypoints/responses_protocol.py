"""The OpenAI Responses API's bodies (/v1/responses), as vLLM serves them: the request, the
input items it takes, and the response object with its output items and usage.

Requests are parsed as strictly as chat's (openai_protocol.py): a wrong type or an unknown
item is a 400 naming the field. Only function tools are served (no hosted tools), and only
text in and out.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from quire.entrypoints.openai_protocol import CacheSaltField, TokenLogprob, _Request
from quire.sampling_params import MAX_LOGPROBS, MAX_SEED

ROLES = ("user", "assistant", "system", "developer")


# --- input items ------------------------------------------------------------------------
class TextPart(_Request):
    """A part of a message: input_text (user, system, developer), output_text (assistant)
    or input_image (its image_url: a data URL, or an http(s) URL where the server fetches);
    files are refused when the conversation is built."""
    type: str
    text: str | None = None
    image_url: str | None = None
    detail: str | None = None


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart] = Field(
        description="a string or a list of {'type': 'input_text', 'text': ...} parts")
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Request):
    """A call an earlier response made (sent back with the conversation)."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Request):
    """A function's result, answering the call with the same call_id."""
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class ReasoningItemIn(_Request):
    """An earlier response's reasoning: accepted, and not put in the prompt (chat templates
    drop earlier turns' reasoning too)."""
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict] = []
    content: list[dict] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("type", "message")  # an easy input message has no type
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItemIn, Tag("reasoning")],
    Discriminator(_item_type)]


# --- tools --------------------------------------------------------------------------------
class FunctionTool(_Request):
    type: Literal["function"] = Field(description="'function' (hosted tools are not served)")
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> dict:
        fn: dict = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters if self.parameters is not None else {
            "type": "object", "properties": {}}
        return {"type": "function", "function": fn}


class FunctionChoice(_Request):
    type: Literal["function"]
    name: str


# --- text format (structured output) ----------------------------------------------------------
class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None

    def as_response_format(self) -> dict | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        spec: dict = {"name": self.name or "response", "schema": self.schema_}
        if self.strict is not None:
            spec["strict"] = self.strict
        return {"type": "json_schema", "json_schema": spec}


class TextConfig(_Request):
    format: TextFormat | None = None


class ReasoningConfig(_Request):
    """Accepted for the clients that send it; reasoning follows the model and the server's
    --reasoning-parser (chat_template_kwargs switch it where the template can)."""
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


# --- the request ----------------------------------------------------------------------------
class ResponsesRequest(CacheSaltField):
    model: str | None = None
    input: str | list[InputItem] = Field(
        description="a string, or a list of input items (messages, function_call, "
                    "function_call_output, reasoning)")
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = Field(None, description="a finite number >= 0")
    top_p: float | None = Field(None, description="a finite number in (0, 1]")
    top_logprobs: int | None = Field(None, description=f"an integer in [0, {MAX_LOGPROBS}]")
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = Field(
        None, description="a list of {'type': 'function', 'name', 'parameters'} tools")
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = Field(
        None, description="'none', 'auto', 'required' or {'type': 'function', 'name': ...}")
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    background: bool = False
    # OpenAI's hosted state (the Conversations API, stored prompt templates): this server
    # keeps neither, so a request naming one is refused rather than answered without it
    conversation: str | dict | None = None
    prompt: dict | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    max_tool_calls: int | None = None
    prompt_cache_key: str | None = None
    # vLLM's extras: the rest of chat's sampling fields, the chat template's variables and
    # the request's scheduling priority
    top_k: int | None = Field(None, description="-1 or 0 (all tokens) or a positive integer")
    min_p: float | None = Field(None, description="a finite number in [0, 1]")
    repetition_penalty: float | None = Field(None, description="a finite number > 0")
    presence_penalty: float | None = Field(None, description="a finite number in [-2, 2]")
    frequency_penalty: float | None = Field(None, description="a finite number in [-2, 2]")
    seed: int | None = Field(None, description=f"an integer in [0, {MAX_SEED}]")
    stop: str | list[str] | None = Field(None, description="a string or a list of strings")
    ignore_eos: bool = False
    chat_template_kwargs: dict | None = Field(
        None, description="a JSON object of extra chat template variables")
    priority: int = Field(0, description="an integer (lower is served earlier)")


# sampling fields that go to the chat request under the same names
PASSED_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                          "presence_penalty", "frequency_penalty", "seed", "stop",
                          "ignore_eos", "cache_salt", "chat_template_kwargs")


# --- the response -------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = []
    logprobs: list[TokenLogprob] | None = None


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = []


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItemOut(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list = []
    content: list[ReasoningText] = []
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class FunctionCallOut(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | ReasoningItemOut | FunctionCallOut


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, cached_tokens: int,
           reasoning_tokens: int = 0) -> ResponseUsage:
        return cls(input_tokens=input_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
                   output_tokens=output_tokens,
                   output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
                   total_tokens=input_tokens + output_tokens)


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed", "cancelled"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = []
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict | None = None
    store: bool = True
    temperature: float | None = None
    text: dict = {"format": {"type": "text"}}
    tool_choice: str | dict = "auto"
    tools: list[dict] = []
    top_p: float | None = None
    top_logprobs: int | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    background: bool = False

    @property
    def output_text(self) -> str:
        return "".join(part.text for item in self.output if isinstance(item, OutputMessage)
                       for part in item.content)
