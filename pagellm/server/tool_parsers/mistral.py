"""Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]. [TOOL_CALLS] is a special token, gone from
the text unless skip_special_tokens is false, so a reply that opens with the bare array counts too."""

from __future__ import annotations

import json

from pagellm.server.tool_parsers.base import Scan, ToolParser
from pagellm.server.tool_parsers.scan import ARGUMENT_KEYS, held_prefix, scan_call_object, skip_ws

MARKER = "[TOOL_CALLS]"


class JsonArrayToolParser(ToolParser):
    """An optional marker, then a JSON array of call objects (or one object); text before the marker and
    after the array is content."""

    marker: str | None = None
    argument_keys = ARGUMENT_KEYS

    def scan(self, text: str, final: bool) -> Scan:
        m = text.find(self.marker) if self.marker else -1
        if m != -1:
            content, j = text[:m], m + len(self.marker)
        else:
            s = skip_ws(text, 0)
            if self.marker and not final and self.marker.startswith(text[s:]):
                return Scan()  # "[TOOL" may be the marker or the array
            if not text.startswith("[", s):
                if final:
                    return Scan(content=text)
                held = held_prefix(text, self.marker) if self.marker else 0
                return Scan(content=text[:len(text) - held] if text[s:] else "")
            content, j = "", s
        out = Scan(content=content)
        j = skip_ws(text, j)
        if j == len(text):
            return out
        if text[j] == "{":  # a single object without the array
            return self._elements(text, j, final, out, closing=None)
        if text[j] != "[":
            return Scan(content=text)
        j = skip_ws(text, j + 1)
        if j == len(text):
            return out
        return self._elements(text, j, final, out, closing="]")

    def _elements(self, text: str, j: int, final: bool, out: Scan, closing: str | None) -> Scan:
        while True:
            if text[j] != "{":
                return Scan(content=text)
            found = scan_call_object(text, j, final, self.argument_keys)
            if found.error:
                return Scan(content=text)
            out.calls.append(found.call)
            if found.end is None:
                return out
            j = skip_ws(text, found.end)
            if j == len(text):
                return out
            if closing and text[j] == ",":
                j = skip_ws(text, j + 1)
                if j == len(text):
                    return out
                continue
            if closing and text[j] != closing:
                return Scan(content=text)
            out.content += text[j + 1 if closing else j:]
            return out


class MistralToolParser(JsonArrayToolParser):
    name = "mistral"
    marker = MARKER
    call_format = f'{MARKER}[{{"name": <function-name>, "arguments": <arguments-json-object>}}, ...]'

    def format_calls(self, calls):
        return MARKER + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)
