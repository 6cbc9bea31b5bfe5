"""DeepSeek R1 (and its distills, QwQ): the answer is reasoning until `</think>`. Its
template puts `<think>\\n` at the end of the prompt, so the model seldom writes the opening
tag; when it does, it is dropped. An answer cut off before `</think>` is all reasoning."""

from __future__ import annotations

from quire.entrypoints.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
