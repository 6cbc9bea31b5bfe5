"""Reasoning output on /v1/chat/completions (`--reasoning-parser`): where each answer starts
(in the reasoning or in the content), the whole answer's split, and a stream's pieces per
choice. Tool calls are read from the content part only (chat_tools.py gets what this leaves).

An answer whose grammar (response_format, guided_*, tool_choice required or named) constrains
it from its first token has no room to reason: it is all content. (vLLM starts the grammar
after `</think>` instead; Quire's grammars cover the whole answer.)
"""

from __future__ import annotations

from dataclasses import dataclass

from quire.entrypoints.reasoning import ReasoningParser, ReasoningStreamer


@dataclass
class ReasoningUse:
    parser: ReasoningParser | None = None   # None: no --reasoning-parser, all is content
    thinking: bool = False                  # the answers start inside the reasoning


async def reasoning_use(serving, req, prompt: list[int], guided: bool) -> ReasoningUse:
    parser = serving.reasoning_parser
    if parser is None:
        return ReasoningUse()
    if guided:
        return ReasoningUse(parser, False)
    tail = await serving.prompt_tail(prompt)
    kwargs = serving.template_kwargs(req.chat_template_kwargs)
    return ReasoningUse(parser, parser.starts_thinking(tail, kwargs))


def split_answer(use: ReasoningUse, text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole answer."""
    if use.parser is None:
        return None, text
    parts = use.parser.extract(text, use.thinking)
    return parts.reasoning, parts.content


class ReasoningDeltas:
    """A streamed answer's text deltas, per choice, into (reasoning, content) pieces."""

    def __init__(self, use: ReasoningUse) -> None:
        self.use = use
        self.streamers: dict[int, ReasoningStreamer] = {}

    def feed(self, index: int, text: str, final: bool) -> tuple[str | None, str]:
        s = self.streamers.get(index)
        if s is None:
            s = self.streamers[index] = self.use.parser.streamer(self.use.thinking)
        delta = s.feed(text)
        if final:  # nothing more comes: release a held-back tail
            rest = s.finish()
            reasoning = ((delta.reasoning or "") + (rest.reasoning or "")) or None
            return reasoning, (delta.content or "") + (rest.content or "")
        return delta.reasoning, delta.content or ""
