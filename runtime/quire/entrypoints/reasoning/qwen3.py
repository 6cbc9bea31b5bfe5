"""Qwen3: `<think>...</think>` then the answer, as vLLM's current Qwen3ReasoningParser reads
it. With thinking on (Qwen3's default) the answer starts in the reasoning, whether the model
writes `<think>` itself (Qwen3's first templates) or the template put it in the prompt
(Qwen3.5's); an answer cut off before `</think>` is all reasoning. With
`chat_template_kwargs: {"enable_thinking": false}` the template closes an empty thinking block
in the prompt and the whole answer is content."""

from __future__ import annotations

from quire.entrypoints.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def starts_thinking(self, prompt_tail: str, template_kwargs: dict) -> bool:
        # `is False`, as the template tests it: only an explicit false turns thinking off
        if template_kwargs.get("enable_thinking", True) is False:
            return False
        return super().starts_thinking(prompt_tail, template_kwargs)
