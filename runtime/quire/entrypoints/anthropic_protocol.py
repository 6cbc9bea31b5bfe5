"""The Anthropic Messages API's bodies (/v1/messages, /v1/messages/count_tokens), as vLLM
serves them for Claude Code and the `anthropic` SDK: the request with its content blocks
(text, tool_use, tool_result, thinking), and the message it answers with.

Parsed as strictly as the OpenAI endpoints (openai_protocol.py): a wrong type or an unknown
block is a 400 naming the field, sent in Anthropic's error shape (errors.py). Only custom
(client) tools are served, and only text in and out.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from quire.entrypoints.openai_protocol import CacheSaltField, _Request
from quire.sampling_params import MAX_SEED


# --- content blocks -------------------------------------------------------------------------
class TextBlockIn(_Request):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None


class ToolUseBlockIn(_Request):
    """A call an earlier assistant turn made."""
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: dict | None = None


class ToolResultBlockIn(_Request):
    """A tool's result, answering the tool_use with the same id."""
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlockIn] | None = None
    is_error: bool | None = None
    cache_control: dict | None = None


class ThinkingBlockIn(_Request):
    """An earlier turn's thinking: accepted, and not put in the prompt."""
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockIn(_Request):
    type: Literal["redacted_thinking"]
    data: str


class Base64ImageSource(_Request):
    type: Literal["base64"]
    media_type: str = Field(description="image/jpeg, image/png, image/gif or image/webp")
    data: str


class URLImageSource(_Request):
    type: Literal["url"]
    url: str


class ImageBlockIn(_Request):
    """An image (a vision-language model's): inline base64, or a URL the server may fetch."""
    type: Literal["image"]
    source: Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]
    cache_control: dict | None = None

    def as_chat_part(self) -> dict:
        src = self.source
        url = src.url if isinstance(src, URLImageSource) else \
            f"data:{src.media_type};base64,{src.data}"
        return {"type": "image_url", "image_url": {"url": url}}


ContentBlockIn = Annotated[
    TextBlockIn | ImageBlockIn | ToolUseBlockIn | ToolResultBlockIn | ThinkingBlockIn
    | RedactedThinkingBlockIn, Field(discriminator="type")]


class MessageParam(_Request):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockIn] = Field(
        description="a string or a list of text, image, tool_use, tool_result and thinking "
                    "blocks")


class ToolParam(_Request):
    type: Literal["custom"] | None = Field(None, description="'custom' or absent (server "
                                                             "tools are not served)")
    name: str
    description: str | None = None
    input_schema: dict
    cache_control: dict | None = None

    def as_chat_tool(self) -> dict:
        fn: dict = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.input_schema
        return {"type": "function", "function": fn}


class ToolChoiceParam(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(_Request):
    """`enabled` / `disabled` switch the chat template's enable_thinking (Qwen3's); the
    budget is not enforced."""
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class JSONOutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(_Request):
    """`format`: the answer follows the JSON schema (the grammar masks every token);
    `effort` is accepted and not acted on."""
    effort: str | None = None
    format: JSONOutputFormat | None = None


class MessagesFields(_Request):
    """What /v1/messages and /v1/messages/count_tokens share: the conversation and tools."""
    model: str
    messages: list[MessageParam] = Field(
        description="a non-empty list of {'role': 'user' | 'assistant', 'content'} messages")
    system: str | list[TextBlockIn] | None = Field(
        None, description="a string or a list of {'type': 'text', 'text': ...} blocks")
    tools: list[ToolParam] | None = Field(
        None, description="a list of {'name', 'description', 'input_schema'} tools")
    tool_choice: ToolChoiceParam | None = Field(
        None, description="{'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}")
    thinking: ThinkingParam | None = None
    chat_template_kwargs: dict | None = Field(
        None, description="a JSON object of extra chat template variables (vLLM's extra)")


class MessagesRequest(MessagesFields, CacheSaltField):
    max_tokens: int = Field(description="a positive integer")
    stop_sequences: list[str] | None = Field(None, description="a list of strings")
    temperature: float | None = Field(None, description="a finite number >= 0")
    top_p: float | None = Field(None, description="a finite number in (0, 1]")
    top_k: int | None = Field(None, description="a positive integer")
    stream: bool = False
    output_config: OutputConfig | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    seed: int | None = Field(None, description=f"an integer in [0, {MAX_SEED}] (vLLM's extra)")


class CountTokensRequest(MessagesFields):
    pass


# --- the answer -----------------------------------------------------------------------------
class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class MessagesUsage(BaseModel):
    """Anthropic's split: input_tokens are the prompt tokens not read from the prefix cache,
    cache_read_input_tokens those that were (their sum is the prompt)."""
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, output_tokens: int, cached_tokens: int) -> MessagesUsage:
        return cls(input_tokens=prompt_tokens - cached_tokens, output_tokens=output_tokens,
                   cache_read_input_tokens=cached_tokens)


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock] = []
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class TokenCount(BaseModel):
    input_tokens: int
