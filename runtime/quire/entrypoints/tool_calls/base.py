"""Tool calls parsed out of model text: the whole text at once, or streamed as OpenAI
`delta.tool_calls` pieces. Each model family says only where its calls lie in the text and
which keys hold the name and the arguments; the streaming skeleton here is shared.

A streamed call first sends {index, id, type, function: {name, arguments: ""}}, then
{index, function: {arguments: piece}} as the arguments arrive; the pieces concatenated are
exactly the `arguments` string of the whole-text parse (the model's own text of the object).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from quire.entrypoints.tool_calls.json_scan import object_fields


def make_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = field(default_factory=make_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None  # text the user should see besides the calls


@dataclass
class DeltaMessage:
    content: str | None = None
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI delta.tool_calls entries

    def __bool__(self) -> bool:
        return bool(self.content) or bool(self.tool_calls)


class ToolParser:
    """A family's format. Subclasses set `name`, `argument_keys`, and `split`."""

    name = ""
    argument_keys: tuple[str, ...] = ("arguments",)

    def split(self, text: str, final: bool) -> tuple[str, list[str]]:
        """(content safe to show so far, call bodies so far: each a JSON object's text, the
        last possibly incomplete). `final`: no more text comes (hold nothing back)."""
        raise NotImplementedError

    # --- whole text ----------------------------------------------------------------------
    def parse(self, text: str) -> ExtractedToolCalls:
        content, bodies = self.split(text, final=True)
        calls = []
        for body in bodies:
            call = self._whole_call(body)
            if call is None:  # not a well-formed call: the text is only content
                return ExtractedToolCalls(False, [], text)
            calls.append(call)
        if not calls:
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, calls, content if content.strip() else None)

    def _whole_call(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        name, span = self._fields(body)
        if span is None or span[1] is None:
            return ToolCall(obj["name"], "{}")
        return ToolCall(name, body[span[0]:span[1]])

    def _fields(self, body: str):
        """(name or None while incomplete, (args start, args end or None) or None)."""
        fields, _ = object_fields(body)
        name = None
        if "name" in fields and fields["name"][1] is not None:
            s, e = fields["name"]
            try:
                name = json.loads(body[s:e])
            except ValueError:
                name = None
        span = next((fields[k] for k in self.argument_keys if k in fields), None)
        return (name if isinstance(name, str) else None), span

    def streamer(self) -> ToolCallStreamer:
        return ToolCallStreamer(self)


class ToolCallStreamer:
    """Feeds on text deltas; returns what to send: content and delta.tool_calls pieces."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content_sent = 0
        self.calls: list[dict] = []  # per call index: {"id", "args_sent"}

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)

    def feed(self, delta_text: str) -> DeltaMessage:
        self.text += delta_text
        return self._diff(final=False)

    def finish(self) -> DeltaMessage:
        """What is left once the text is complete (held-back content, a trailing number)."""
        return self._diff(final=True)

    def _diff(self, final: bool) -> DeltaMessage:
        content, bodies = self.parser.split(self.text, final)
        out = DeltaMessage()
        if len(content) > self.content_sent:
            out.content = content[self.content_sent:]
            self.content_sent = len(content)
        for index, body in enumerate(bodies):
            name, span = self.parser._fields(body)
            if index == len(self.calls):
                if name is None:
                    break  # later calls wait for this one's name
                call_id = make_call_id()
                self.calls.append({"id": call_id, "args_sent": 0})
                out.tool_calls.append({"index": index, "id": call_id, "type": "function",
                                       "function": {"name": name, "arguments": ""}})
            sent = self.calls[index]["args_sent"]
            if span is None:
                continue
            start, end = span
            if end is None:  # still arriving: an object or string so far is all arguments
                end = len(body) if body[start:start + 1] in ('{', '[', '"') else start
            piece = body[start + sent:end]
            if piece:
                self.calls[index]["args_sent"] += len(piece)
                out.tool_calls.append({"index": index, "function": {"arguments": piece}})
        return out
