"""Tool calling, independent of HTTP: parsers per model family (whole text and streamed),
the parser a chat template implies, grammars for tool_choice, and prompts with tools.

    parser = get_tool_parser(name or auto_tool_parser(architecture, tokenizer.chat_template))
    parser.parse(text) -> ExtractedToolCalls           # non-streamed reply
    s = parser.streamer(); s.feed(delta) / s.finish()  # -> DeltaMessage(content, tool_calls)
    tool_choice_guided_decoding(tools, tool_choice, parallel_tool_calls, parser_name)
    render_chat_prompt(tokenizer, messages, tools, chat_template)
"""

from quire.entrypoints.tool_calls.base import (
                                               DeltaMessage,
                                               ExtractedToolCalls,
                                               ToolCall,
                                               ToolCallStreamer,
                                               ToolParser,
)
from quire.entrypoints.tool_calls.grammar import (
                                               chosen_tools,
                                               tool_choice_guided_decoding,
                                               validate_tools,
)
from quire.entrypoints.tool_calls.registry import (
                                               TOOL_PARSERS,
                                               auto_tool_parser,
                                               detect_tool_parser,
                                               get_tool_parser,
)
from quire.entrypoints.tool_calls.render import render_chat_prompt, template_inputs

__all__ = ["DeltaMessage", "ExtractedToolCalls", "ToolCall", "ToolCallStreamer", "ToolParser",
           "TOOL_PARSERS", "auto_tool_parser", "chosen_tools", "detect_tool_parser",
           "get_tool_parser",
           "render_chat_prompt", "template_inputs", "tool_choice_guided_decoding",
           "validate_tools"]
