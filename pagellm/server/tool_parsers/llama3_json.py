"""Llama 3.1/3.2 JSON tool calls: {"name": ..., "parameters": {...}} at the start of the reply, possibly
after <|python_tag|>, several separated by ";". Anything else is plain content."""

from __future__ import annotations

import json

from pagellm.server.tool_parsers.base import Scan, ToolParser
from pagellm.server.tool_parsers.scan import scan_call_object, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    call_format = ('{"name": <function-name>, "parameters": <arguments-json-object>} as the whole reply, '
                   'several separated by "; "')

    def scan(self, text: str, final: bool) -> Scan:
        s = skip_ws(text, 0)
        if not final and PYTHON_TAG.startswith(text[s:]):
            return Scan()  # nothing yet, or the start of the tag
        j = s + len(PYTHON_TAG) if text.startswith(PYTHON_TAG, s) else s
        j = skip_ws(text, j)
        if j == len(text):
            return Scan()
        if text[j] != "{":
            return Scan(content=text)
        out = Scan()
        while True:
            found = scan_call_object(text, j, final)
            if found.error:
                return Scan(content=text)  # JSON but not a call: the reply is text
            out.calls.append(found.call)
            if found.end is None:
                return out
            j = skip_ws(text, found.end)
            if j < len(text) and text[j] == ";":
                j = skip_ws(text, j + 1)
                if j == len(text):
                    return out
                if text[j] == "{":
                    continue
            out.content = text[j:]
            return out

    def format_calls(self, calls):
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)
