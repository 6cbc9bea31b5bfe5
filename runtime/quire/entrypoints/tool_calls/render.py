"""Chat prompts with tools: the template gets `tools`, assistant `tool_calls` and
`role: "tool"` results. Templates that know tools (Qwen2.5, Llama 3.1) render them their own
way; for one that doesn't (SmolLM2's), tools go into the system prompt Hermes-style, calls
become <tool_call> text and results <tool_response> user turns, so the Hermes parser reads the
replies.
"""

from __future__ import annotations

import copy
import json

from quire.validation import QuireValidationError

HERMES_SYSTEM = (
    "You are a function calling AI model. You may call one or more functions to assist with "
    "the user query. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def render_chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                       chat_template: str | None = None,
                       add_generation_prompt: bool = True,
                       continue_final_message: bool = False) -> list[int]:
    """Token ids of the conversation through the chat template, tools included."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise QuireValidationError(
            "chat_template", "this model's tokenizer has no chat template; pass chat_template")
    messages, kwargs = template_inputs(template, messages, tools)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message,
                                        tokenize=True, chat_template=chat_template,
                                        return_dict=False, **kwargs)
    return list(ids)


def with_tools(template: str, messages: list[dict], tools: list[dict] | None,
               template_kwargs: dict) -> tuple[list[dict], dict]:
    """template_inputs where there are tools, calls or results (else the messages as they
    are), merged over `template_kwargs`: an image chat's rendering takes them so."""
    if not tools and not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return messages, template_kwargs
    messages, extra = template_inputs(template, messages, tools)
    return messages, {**template_kwargs, **extra}


def template_inputs(template: str, messages: list[dict],
                    tools: list[dict] | None) -> tuple[list[dict], dict]:
    """(messages, extra template variables) for `template`: its own tool rendering when it
    knows tools, else the Hermes-style messages. QuireValidationError names the bad message."""
    messages = _normalize(messages)
    if template_knows_tools(template):
        return messages, ({"tools": tools} if tools else {})
    return _hermes_messages(messages, tools), {}


def _normalize(messages: list[dict]) -> list[dict]:
    """OpenAI's shapes to what templates expect: string arguments parsed to objects (templates
    serialize them with tojson), content None as ""."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise QuireValidationError("messages",
                                       f"messages[{i}] must be an object with a 'role'", m)
        m = copy.deepcopy(m)
        if m.get("content") is None:
            m["content"] = ""
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"] or "{}")
                except ValueError:
                    raise QuireValidationError(
                        "messages", f"messages[{i}].tool_calls: arguments must be a JSON "
                        f"object's text, got {fn['arguments']!r}", fn["arguments"]) from None
        if m["role"] == "tool" and not m.get("tool_call_id"):
            raise QuireValidationError(
                "messages", f"messages[{i}]: a 'tool' message needs its tool_call_id")
        out.append(m)
    return out


def _with_text(content: str | list, text: str) -> str | list:
    """Text added at the end of a message's content: a string, or a vision chat's parts."""
    if isinstance(content, list):
        return [*content, {"type": "text", "text": text}]
    return content + text


def _hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                              "arguments": c["function"].get("arguments", {})})
                + "\n</tool_call>" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": _with_text(m["content"], calls)})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n"
                                                   f"</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        system = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": _with_text(out[0]["content"], "\n\n" + system)}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out
