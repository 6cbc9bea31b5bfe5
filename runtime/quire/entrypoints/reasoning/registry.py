"""Reasoning parsers by name (`--reasoning-parser`, vLLM's names)."""

from __future__ import annotations

from quire.entrypoints.reasoning.base import ReasoningParser
from quire.entrypoints.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from quire.entrypoints.reasoning.openai_gptoss import GptOssReasoningParser
from quire.entrypoints.reasoning.qwen3 import Qwen3ReasoningParser
from quire.validation import QuireValidationError

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "openai_gptoss": GptOssReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise QuireValidationError(
            "reasoning_parser", f"reasoning_parser must be one of "
            f"{', '.join(REASONING_PARSERS)}, got {name!r}", name) from None
