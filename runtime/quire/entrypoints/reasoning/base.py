"""Reasoning split out of model text: the text between `<think>` and `</think>` is the
answer's reasoning, the rest its content.

One state machine serves both whole answers and streams, so the streamed pieces always
concatenate to the whole answer's fields, however the text is cut into deltas:

    thinking  -> text is reasoning; a `<think>` before any reasoning text but whitespace is
                 dropped (templates that leave the tag to the model); `</think>` is dropped and
                 ends the reasoning
    content   -> text is content, tags and all

Whether an answer starts thinking is the parser's call, from the prompt's tail and the chat
template's kwargs (`starts_thinking`). A tail that could still become a tag is held back until
the next delta decides it (or the answer ends: then it is released as what it was).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReasoningDelta:
    reasoning: str | None = None
    content: str | None = None


class ReasoningParser:
    """A family's reasoning format. Subclasses set `name`, and override `starts_thinking`
    when the family has a switch of its own."""

    name = ""
    start_tag = "<think>"
    end_tag = "</think>"
    needs_special_tokens = False  # its markers are special tokens: keep them in the text

    def starts_thinking(self, prompt_tail: str, template_kwargs: dict) -> bool:
        """Whether the answer to a prompt ending in `prompt_tail` begins inside the
        reasoning. A prompt whose last tag is a closed `</think>` (a template that switched
        thinking off renders an empty block) starts the answer in content, as vLLM's
        prompt_is_reasoning_end does."""
        return not prompt_tail.rstrip().endswith(self.end_tag)

    def streamer(self, thinking: bool) -> ReasoningStreamer:
        return ReasoningStreamer(self, thinking)

    def extract(self, text: str, thinking: bool) -> ReasoningDelta:
        """A whole answer's (reasoning, content); None for an empty part."""
        s = self.streamer(thinking)
        first, rest = s.feed(text), s.finish()
        return ReasoningDelta(_join(first.reasoning, rest.reasoning),
                              _join(first.content, rest.content))


class ReasoningStreamer:
    """One answer's text deltas in, its reasoning and content pieces out."""

    def __init__(self, parser: ReasoningParser, thinking: bool) -> None:
        self.start, self.end = parser.start_tag, parser.end_tag
        self.thinking = thinking
        self.may_open = thinking  # a leading start tag is still droppable
        self.held = ""

    def feed(self, text: str) -> ReasoningDelta:
        return self._step(text, final=False)

    def finish(self) -> ReasoningDelta:
        """The held-back tail, once no more text comes."""
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> ReasoningDelta:
        buf, self.held = self.held + text, ""
        reasoning: list[str] = []
        while buf and self.thinking:
            if self.may_open:
                body = buf.lstrip()
                lead = buf[:len(buf) - len(body)]
                if body.startswith(self.start):
                    reasoning.append(lead)
                    buf, self.may_open = body[len(self.start):], False
                    continue
                if self.start.startswith(body) and not final:  # may still become the tag
                    reasoning.append(lead)
                    self.held = body
                    return _delta(reasoning, "")
                self.may_open = False
            end = buf.find(self.end)
            if end >= 0:
                reasoning.append(buf[:end])
                buf, self.thinking = buf[end + len(self.end):], False
                break
            keep = 0 if final else _partial_tail(buf, self.end)
            reasoning.append(buf[:len(buf) - keep])
            self.held, buf = buf[len(buf) - keep:], ""
        return _delta(reasoning, buf)


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _delta(reasoning: list[str], content: str) -> ReasoningDelta:
    return ReasoningDelta("".join(reasoning) or None, content or None)


def _join(a: str | None, b: str | None) -> str | None:
    return ((a or "") + (b or "")) or None
