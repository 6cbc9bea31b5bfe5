"""A chat prompt that ends inside its last message, for the answer to continue it: vLLM's
`continue_final_message` on chat completions and /tokenize, and the Messages API's final
assistant turn (Anthropic's "prefill": the reply goes on from that text).

The model's own template renders it through transformers' `continue_final_message`, which
tags the last message's text, renders, and cuts the prompt where the tag lands (so the
template's end of turn is gone). A request's own template renders in the sandbox
(request_chat_template), which has no such option: `tag_final_message` and `cut_at_tag` do the
same there, in transformers' way, so both give the same prompt.

Public interface:
    check_continuation(add_generation_prompt, continue_final_message, messages, where)
        400 naming continue_final_message when both are set or there is nothing to continue
    template_rejected(error) -> OpenAIError        a template's ValueError as a 400
    tag_final_message(conversation) -> conversation    (a copy) the last text tagged
    cut_at_tag(text) -> text                          the rendered prompt cut at the tag
"""

from __future__ import annotations

import copy

from quire.entrypoints.errors import OpenAIError, bad_request

FIELD = "continue_final_message"
TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' own


def check_continuation(add_generation_prompt: bool, continue_final_message: bool,
                       messages: list, where: str = "messages") -> None:
    """`messages`: the request's (ChatMessage models); `where`: their field's name."""
    if not continue_final_message:
        return
    if add_generation_prompt:
        raise bad_request("continue_final_message continues the last message, so "
                          "add_generation_prompt must be false (it opens a new one)", FIELD)
    if not messages:
        raise bad_request(f"continue_final_message needs a last message to continue; {where} "
                          "is empty", FIELD)
    content = messages[-1].content
    if isinstance(content, list) and not any(p.type == "text" for p in content):
        raise bad_request(f"continue_final_message continues the last message's text, but "
                          f"{where}[{len(messages) - 1}] has no text part", FIELD)


def template_rejected(error: Exception) -> OpenAIError:
    field = FIELD if FIELD in str(error) else "messages"
    return bad_request(f"the chat template rejected these messages: {error}", field)


def tag_final_message(conversation: list[dict]) -> list[dict]:
    out = copy.deepcopy(conversation)
    if not out:
        raise ValueError("continue_final_message is set but the conversation is empty")
    last = out[-1]
    content = last.get("content")
    if isinstance(content, list):
        for part in reversed(content):
            if isinstance(part, dict) and "text" in part:
                part["text"] = part["text"] + TAG
                return out
        raise ValueError("continue_final_message is set but the final message has no text "
                         "to continue")
    last["content"] = (content or "") + TAG
    return out


def cut_at_tag(text: str) -> str:
    at = text.rfind(TAG.strip())
    if at < 0:
        raise ValueError("continue_final_message is set but the chat template dropped the "
                         "final message's text, so there is nothing to continue")
    if text[at:at + len(TAG)] == TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space
