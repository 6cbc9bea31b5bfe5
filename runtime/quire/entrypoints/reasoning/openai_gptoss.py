"""gpt-oss's harmony format: an answer is a run of messages, each a header, `<|message|>`, a
body and an end marker, the first one's `<|start|>assistant` already in the prompt:

    <|channel|>analysis<|message|>Let me think.<|end|>
    <|start|>assistant<|channel|>final<|message|>Paris.<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(without the line breaks). The `analysis` channel is reasoning_content; `final` and
`commentary` without a recipient (a preamble) are content; a message to `functions.<name>`
(in the header, before or after the channel) is a tool call, which this parser leaves in the
content as `<|channel|>commentary to=functions.<name><|message|><arguments><|end|>` for the
`openai` tool parser (tool_calls/openai.py) to read; a message to another recipient (the
built-in browser or python tools) is reasoning. The markers are special tokens, so the chat
route keeps them in the text for this parser (`needs_special_tokens`); `<|return|>` and
`<|call|>` end generation and are not in the text.

An answer with no harmony markers at all is content. A header cut off (by max_tokens) before
its `<|message|>` shows nothing; a body cut off shows what it has.
"""

from __future__ import annotations

import re

from quire.entrypoints.reasoning.base import ReasoningDelta, ReasoningParser, _partial_tail

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CALL, RETURN = "<|call|>", "<|return|>"
ENDS = (END, CALL, RETURN)
TOOL_CALL_OPEN = f"{CHANNEL}commentary to=functions."  # how a call is left in the content
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")

REASONING, CONTENT = "reasoning", "content"


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    needs_special_tokens = True

    def starts_thinking(self, prompt_tail: str, template_kwargs: dict) -> bool:
        return False  # the channels say where each part goes, not a start state

    def streamer(self, thinking: bool) -> HarmonyStreamer:
        return HarmonyStreamer()


def route(header: str) -> tuple[str, str | None]:
    """(where a message's body goes: reasoning or content, the function it calls or None)."""
    recipient = _RECIPIENT.search(header)
    channel = _CHANNEL.search(header)
    channel = channel.group(1) if channel else None
    if recipient is not None:
        to = recipient.group(1)
        if to.startswith("functions."):
            return CONTENT, to.removeprefix("functions.")
        return REASONING, None  # a built-in tool's call: part of the model's reasoning
    return (REASONING if channel == "analysis" else CONTENT), None


class HarmonyStreamer:
    """One answer's text deltas in, (reasoning, content) pieces out; the pieces concatenate to
    the whole answer's fields however the text is cut."""

    def __init__(self) -> None:
        self.held = ""
        self.body: str | None = None   # None: reading a header; else where the body goes
        self.call: str | None = None   # the function the current body calls

    def feed(self, text: str) -> ReasoningDelta:
        return self._step(text, final=False)

    def finish(self) -> ReasoningDelta:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> ReasoningDelta:
        buf, self.held = self.held + text, ""
        out = {REASONING: [], CONTENT: []}
        while buf:
            if self.body is None:
                i = buf.find(MESSAGE)
                if i < 0:
                    if not final:
                        self.held = buf  # the header is not complete yet
                    elif "<|" not in buf:
                        out[CONTENT].append(buf)  # no harmony at all: plain content
                    break
                self.body, self.call = route(buf[:i])
                if self.call is not None:
                    out[CONTENT].append(f"{TOOL_CALL_OPEN}{self.call}{MESSAGE}")
                buf = buf[i + len(MESSAGE):]
                continue
            ends = [(j, m) for m in ENDS if (j := buf.find(m)) >= 0]
            if ends:
                j, marker = min(ends)
                out[self.body].append(buf[:j])
                if self.call is not None:
                    out[CONTENT].append(END)
                buf, self.body, self.call = buf[j + len(marker):], None, None
                continue
            keep = 0 if final else max(_partial_tail(buf, m) for m in ENDS)
            out[self.body].append(buf[:len(buf) - keep])
            self.held, buf = buf[len(buf) - keep:], ""
        return ReasoningDelta("".join(out[REASONING]) or None, "".join(out[CONTENT]) or None)
