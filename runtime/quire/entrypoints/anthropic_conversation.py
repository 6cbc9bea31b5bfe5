"""The Messages API in chat's terms: `system` and the messages' blocks as chat messages
(tool_use blocks become an assistant's tool_calls, tool_result blocks `role: "tool"`
messages), the request as a ChatCompletionRequest, and a chat answer's parts as content
blocks and a stop_reason.

    tool_choice   {"type": "auto"}  "any"       "tool" + name             "none"
    chat's        "auto"            "required"  {"function": {"name"}}    "none"
"""

from __future__ import annotations

import json
import uuid

from quire.entrypoints.anthropic_protocol import (
    ContentBlock,
    ImageBlockIn,
    MessagesFields,
    MessagesRequest,
    TextBlock,
    TextBlockIn,
    ThinkingBlock,
    ToolResultBlockIn,
    ToolUseBlock,
    ToolUseBlockIn,
)
from quire.entrypoints.chat_run import AnswerParts
from quire.entrypoints.chat_translation import as_chat_request, renamed_errors
from quire.entrypoints.errors import bad_request
from quire.entrypoints.openai_protocol import ChatCompletionRequest

# chat's names for what the Messages API calls otherwise (in the 400s chat's checks raise)
RENAMES = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens",
           "response_format": "output_config", "continue_final_message": "messages"}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "cache_salt")


def chat_messages(req: MessagesFields) -> list[dict]:
    system = _text(req.system) if req.system is not None else None
    messages = [{"role": "system", "content": system}] if system else []
    for m in req.messages:
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            messages.append(_assistant(m.content))
        else:
            messages.extend(_user(m.content))
    return messages


def _text(content: str | list[TextBlockIn] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(b.text for b in content)


def _assistant(blocks) -> dict:
    texts = [b.text for b in blocks if isinstance(b, TextBlockIn)]
    message: dict = {"role": "assistant", "content": "\n".join(texts)}
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in blocks if isinstance(b, ToolUseBlockIn)]
    if calls:
        message["tool_calls"] = calls
    return message  # thinking blocks: not part of the prompt


def _user(blocks) -> list[dict]:
    """Tool results as `tool` messages, the text between them as user messages, in order."""
    out, texts = [], []
    for b in blocks:
        if isinstance(b, TextBlockIn):
            texts.append(b.text)
        elif isinstance(b, ImageBlockIn):
            texts.append(b)
        elif isinstance(b, ToolResultBlockIn):
            if texts:
                out.append({"role": "user", "content": _user_content(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                        "content": _text(b.content)})
        elif isinstance(b, ToolUseBlockIn):
            raise bad_request("tool_use blocks belong in assistant messages", "messages")
    if texts or not out:
        out.append({"role": "user", "content": _user_content(texts)})
    return out


def _user_content(pieces: list) -> str | list[dict]:
    """Text joined, or chat's parts when images are among them (text and images in order)."""
    if not any(isinstance(p, ImageBlockIn) for p in pieces):
        return "\n".join(pieces)
    return [p.as_chat_part() if isinstance(p, ImageBlockIn) else {"type": "text", "text": p}
            for p in pieces]


def _continued(req: MessagesFields) -> dict:
    """A final assistant message is the reply's start: the answer continues its text (the
    prompt ends inside it, chat_continuation). As Anthropic, that text may not end in
    whitespace (the model would continue after a space it did not write)."""
    if not req.messages or req.messages[-1].role != "assistant":
        return {}
    last, where = req.messages[-1], f"messages[{len(req.messages) - 1}].content"
    blocks = [] if isinstance(last.content, str) else last.content
    if any(isinstance(b, ToolUseBlockIn) for b in blocks):
        raise bad_request(f"{where}: a final assistant message is continued as the reply, so "
                          "it can't hold tool_use blocks (their tool_result comes in a user "
                          "message after it)", "messages")
    text = last.content if isinstance(last.content, str) else \
        "\n".join(b.text for b in blocks if isinstance(b, TextBlockIn))
    if text != text.rstrip():
        raise bad_request(f"{where}: final assistant content cannot end with trailing "
                          "whitespace", "messages")
    return {"add_generation_prompt": False, "continue_final_message": True}


def tool_fields(req: MessagesFields) -> dict:
    """tools, tool_choice and parallel_tool_calls in chat's spelling."""
    fields: dict = {}
    if req.tools:
        fields["tools"] = [t.as_chat_tool() for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice.name is required when tool_choice.type is "
                                  "'tool'", "tool_choice")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required",
                                     "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use is not None:
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


def template_kwargs(req: MessagesFields) -> dict | None:
    kwargs = dict(req.chat_template_kwargs or {})
    if req.thinking is not None and req.thinking.type in ("enabled", "disabled"):
        kwargs.setdefault("enable_thinking", req.thinking.type == "enabled")
    return kwargs or None


def chat_request(req: MessagesFields, stream: bool = False) -> ChatCompletionRequest:
    body: dict = {"model": req.model, "messages": chat_messages(req), "stream": stream,
                  **tool_fields(req), **_continued(req)}
    kwargs = template_kwargs(req)
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        body.update({k: getattr(req, k) for k in SAMPLING_FIELDS
                     if getattr(req, k) is not None})
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
        if req.output_config is not None and req.output_config.format is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": req.output_config.format.schema_}}
    return as_chat_request(body, RENAMES)


def messages_names():
    """Chat's 400s re-labelled with the Messages API's field names."""
    return renamed_errors(RENAMES)


# --- the answer ---------------------------------------------------------------------------
def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def content_blocks(parts: AnswerParts) -> list[ContentBlock]:
    blocks: list[ContentBlock] = []
    if parts.reasoning:
        blocks.append(ThinkingBlock(thinking=parts.reasoning))
    if parts.content:
        blocks.append(TextBlock(text=parts.content))
    blocks.extend(ToolUseBlock(id=tool_use_id(c.id), name=c.function.name,
                               input=tool_input(c.function.arguments))
                  for c in parts.tool_calls)
    return blocks


def tool_input(arguments: str) -> dict:
    """A call's arguments as tool_use's `input` object (the parsers give a JSON object's
    text; anything else is wrapped, never dropped)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def stop_reason(finish_reason: str | None, stop: int | str | None
                ) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of chat's finish_reason and stop_reason."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return ("end_turn", None) if finish_reason is not None else (None, None)


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"
