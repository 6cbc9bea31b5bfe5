"""Reasoning output: the `<think>` part of an answer apart from its content, whole or
streamed, independent of HTTP.

    parser = get_reasoning_parser("qwen3")
    thinking = parser.starts_thinking(prompt_tail, chat_template_kwargs)
    parser.extract(text, thinking) -> ReasoningDelta(reasoning, content)   # whole answer
    s = parser.streamer(thinking); s.feed(delta) / s.finish()              # streamed
"""

from quire.entrypoints.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningStreamer
from quire.entrypoints.reasoning.registry import REASONING_PARSERS, get_reasoning_parser

__all__ = ["REASONING_PARSERS", "ReasoningDelta", "ReasoningParser", "ReasoningStreamer",
           "get_reasoning_parser"]
