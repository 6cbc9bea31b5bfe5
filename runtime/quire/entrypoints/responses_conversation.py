"""The Responses API in chat's terms: a request's input items (after the stored conversation
that `previous_response_id` names) as chat messages, the request as a ChatCompletionRequest,
and a chat answer's parts as output items. `instructions` become the first system message of
this request only: a later turn that continues the conversation does not inherit them, as in
OpenAI's API.
"""

from __future__ import annotations

import json
import uuid

from quire.entrypoints.chat_run import AnswerParts
from quire.entrypoints.chat_translation import as_chat_request, renamed_errors
from quire.entrypoints.errors import bad_request
from quire.entrypoints.openai_protocol import ChatCompletionRequest
from quire.entrypoints.responses_protocol import (
    PASSED_SAMPLING_FIELDS,
    FunctionCallItem,
    FunctionCallOut,
    FunctionCallOutputItem,
    MessageItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItemOut,
    ReasoningText,
    ResponsesRequest,
    TextPart,
)
from quire.entrypoints.responses_store import StoredResponse

TEXT_PARTS = ("input_text", "output_text", "text")
# chat's names for what the Responses API calls otherwise (in the 400s chat's checks raise)
RENAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text",
           "logprobs": "top_logprobs"}


def conversation_of(req: ResponsesRequest, previous: StoredResponse | None) -> list[dict]:
    """The chat messages of the conversation so far, without instructions."""
    messages = [dict(m) for m in previous.conversation] if previous is not None else []
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    for i, item in enumerate(req.input):
        if isinstance(item, MessageItem):
            messages.append({"role": item.role,
                             "content": _parts(item.content, f"input[{i}].content")})
        elif isinstance(item, FunctionCallItem):
            _check_arguments(item.arguments, f"input[{i}].arguments")
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last["tool_calls"] = [*last.get("tool_calls", []), call]  # one turn's calls
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, f"input[{i}].output")})
        # reasoning items: not part of the prompt
    return messages


def _check_arguments(arguments: str, where: str) -> None:
    """chat's check (tool_calls/render.py), named by the item's own place: chat's would name
    its message's, whose index differs."""
    try:
        json.loads(arguments or "{}")
    except ValueError:
        raise bad_request(f"{where} must be a JSON object's text, got {arguments[:100]!r}",
                          "input") from None


def _parts(content: str | list[TextPart], where: str) -> str | list[dict]:
    """A message's text, or chat's parts when it has input_image parts."""
    if isinstance(content, str) or not any(p.type == "input_image" for p in content):
        return _text(content, where)
    parts = []
    for j, part in enumerate(content):
        if part.type == "input_image":
            if not part.image_url:
                raise bad_request(f"{where}[{j}]: an input_image part needs image_url (a data "
                                  "URL or an http(s) URL; file_id is not served)", "input")
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
        else:
            parts.append({"type": "text", "text": _text([part], where)})
    return parts


def _text(content: str | list[TextPart], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS:
            raise bad_request(f"{where}[{j}]: parts of type {part.type!r} are not supported; "
                              f"only input_text, output_text and input_image parts",
                              "input")
        if part.text is None:
            raise bad_request(f"{where}[{j}]: an {part.type} part needs its 'text' (a string)",
                              "input")
        texts.append(part.text)
    return "\n".join(texts)


def chat_request(req: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
    """The chat request that answers `req` (its fields were checked when it was parsed)."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict = {"model": req.model, "messages": system + conversation, "stream": req.stream,
                  "max_tokens": req.max_output_tokens,
                  "parallel_tool_calls": req.parallel_tool_calls}
    body.update({k: getattr(req, k) for k in PASSED_SAMPLING_FIELDS
                 if getattr(req, k) is not None})
    if req.top_logprobs is not None:
        body.update(logprobs=True, top_logprobs=req.top_logprobs)
    if req.tools:
        body["tools"] = [t.as_chat_tool() for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else {
            "type": "function", "function": {"name": req.tool_choice.name}}
    if req.text is not None and req.text.format is not None:
        body["response_format"] = req.text.format.as_response_format()
    return as_chat_request(body, RENAMES)


def responses_names():
    """Chat's 400s re-labelled with the Responses API's field names."""
    return renamed_errors(RENAMES)


# --- output -------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(parts: AnswerParts, logprobs: bool) -> list[OutputItem]:
    """Reasoning first, then the message (unless the answer is only calls), then the calls."""
    status = "incomplete" if parts.finish_reason == "length" else "completed"
    items: list[OutputItem] = []
    if parts.reasoning:
        items.append(ReasoningItemOut(id=new_id("rs"), status=status,
                                      content=[ReasoningText(text=parts.reasoning)]))
    if parts.content or not parts.tool_calls:
        lps = parts.logprobs.content if logprobs and parts.logprobs is not None else None
        items.append(OutputMessage(id=new_id("msg"), status=status, content=[
            OutputText(text=parts.content or "", logprobs=lps)]))
    items.extend(FunctionCallOut(id=new_id("fc"), call_id=c.id, name=c.function.name,
                                 arguments=c.function.arguments) for c in parts.tool_calls)
    return items


def answered(conversation: list[dict], output: list[OutputItem]) -> list[dict]:
    """The conversation with the response's answer: what a next turn continues."""
    content = "".join(p.text for item in output if isinstance(item, OutputMessage)
                      for p in item.content)
    message: dict = {"role": "assistant", "content": content}
    calls = [{"id": item.call_id, "type": "function",
              "function": {"name": item.name, "arguments": item.arguments}}
             for item in output if isinstance(item, FunctionCallOut)]
    if calls:
        message["tool_calls"] = calls
    return [*conversation, message]
