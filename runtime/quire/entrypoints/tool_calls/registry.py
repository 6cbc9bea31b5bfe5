"""Tool parsers by name (`--tool-call-parser`), and which one a chat template implies."""

from __future__ import annotations

from quire.entrypoints.tool_calls.base import ToolParser
from quire.entrypoints.tool_calls.hermes import HermesToolParser
from quire.entrypoints.tool_calls.llama3_json import PYTHON_TAG, Llama3JsonToolParser
from quire.entrypoints.tool_calls.openai import OpenAIToolParser
from quire.validation import QuireValidationError

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "openai": OpenAIToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise QuireValidationError(
            "tool_call_parser", f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, "
            f"got {name!r}", name) from None


def detect_tool_parser(chat_template: str | None) -> str:
    """The family a template's tool format belongs to. A template that knows no tools (as
    SmolLM2's) gets tools rendered Hermes-style by render.py, so it parses as Hermes too."""
    return template_tool_parser(chat_template) or "hermes"


def template_tool_parser(chat_template: str | None) -> str | None:
    """The tool format a template shows, or None when it shows none we parse."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if PYTHON_TAG in template or "Environment: ipython" in template or (
            '"parameters"' in template and "tools" in template):
        return "llama3_json"
    return None


# Families whose own format is known, by the start of their architecture name. Gemma's and
# Phi's templates define no tool format of theirs (or one no parser here reads): only what a
# template shows counts, and none means no tool calling rather than a format the model was
# never taught.
FAMILY_TOOL_PARSERS: tuple[tuple[str, str | None], ...] = (
    ("qwen", "hermes"),   # Qwen2, Qwen2.5, Qwen3: <tool_call> JSON </tool_call>
    ("gemma", None),
    ("phi", None),
    ("gptoss", "openai"),  # harmony: read with --reasoning-parser openai_gptoss
)


def auto_tool_parser(architecture: str, chat_template: str | None) -> str | None:
    """`--tool-call-parser auto`: the model family's format, else the template's (Hermes for
    templates that know no tools, as render.py renders them); None: this model has none."""
    arch = (architecture or "").lower()
    for prefix, parser in FAMILY_TOOL_PARSERS:
        if arch.startswith(prefix):
            return parser or template_tool_parser(chat_template)
    return detect_tool_parser(chat_template)
