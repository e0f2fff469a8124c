"""What every tool-call parser provides: `extract` for a finished text and `streamer()` for a growing one.

A parser implements only `scan(text, final)`: the text outside tool-call markup (`content`) and the calls
found so far. Both the non-streaming and the streaming path are built on that one function, so a stream's
concatenated deltas equal the non-streaming reply for the same text (the exception: malformed markup
found only after part of a call was streamed, which cannot be taken back).

`scan` must keep `content` and each call's `arguments` append-only as the text grows: text that may still
turn into markup (a partial "<tool_") is held back from `content` until it is decided.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from pagellm.server.tool_parsers.scan import PartialCall


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_tool_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Scan:
    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser:
    """Subclasses set `name` (vLLM's --tool-call-parser name), `call_format` (how a call is written, shown to
    models whose template ignores tools) and implement `scan` and `format_calls`."""

    name = ""
    call_format = ""

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def format_calls(self, calls: list[tuple[str, dict | str]]) -> str:
        """(name, arguments) pairs written the way this model family writes calls (for past assistant turns)."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Finished text -> (content outside the calls, the calls). With calls, the content loses its trailing
        whitespace and is None if nothing is left; without, it is the text as generated."""
        scan = self.scan(text, final=True)
        calls = [ToolCall(c.name, c.arguments) for c in scan.calls if c.name is not None]
        if not calls:
            return scan.content, []
        return scan.content.rstrip() or None, calls

    def streamer(self) -> ToolCallStreamer:
        return ToolCallStreamer(self)


class ToolCallStreamer:
    """Growing text -> OpenAI chat deltas: {"content": ...} and/or {"tool_calls": [...]}.

    A call's first entry carries index, id, type and function.name (and the arguments so far, possibly "");
    later entries carry argument fragments only. Whitespace at the end of the content is held until more
    content follows (or the text ends without calls), so the streamed content equals `extract`'s."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self._content_sent = 0
        self._args_sent: list[int] = []
        self.ids: list[str] = []

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)

    def feed(self, text: str, final: bool = False) -> dict | None:
        scan = self.parser.scan(text, final)
        delta: dict = {}
        content = scan.content
        has_calls = any(c.name is not None for c in scan.calls)
        visible = content if final and not has_calls else content.rstrip()
        if len(visible) > self._content_sent:
            delta["content"] = visible[self._content_sent:]
            self._content_sent = len(visible)
        entries = []
        for index, call in enumerate(scan.calls):
            if index == len(self.ids):
                if call.name is None:
                    break
                self.ids.append(new_tool_call_id())
                self._args_sent.append(len(call.arguments))
                entries.append({"index": index, "id": self.ids[index], "type": "function",
                                "function": {"name": call.name, "arguments": call.arguments}})
                continue
            fragment = call.arguments[self._args_sent[index]:]
            if fragment:
                self._args_sent[index] = len(call.arguments)
                entries.append({"index": index, "function": {"arguments": fragment}})
        if entries:
            delta["tool_calls"] = entries
        return delta or None
