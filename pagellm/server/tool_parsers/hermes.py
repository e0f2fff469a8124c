"""Hermes / Qwen style: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number of them, with
free text around them (the content)."""

from __future__ import annotations

import json

from pagellm.server.tool_parsers.base import Scan, ToolParser
from pagellm.server.tool_parsers.scan import held_prefix, scan_call_object, skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    call_format = (f'{START}\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n{END} '
                   f'for each call')

    def scan(self, text: str, final: bool) -> Scan:
        out = Scan()
        pos = 0
        while True:
            i = text.find(START, pos)
            if i == -1:
                tail = text[pos:]
                out.content += tail if final else tail[:len(tail) - held_prefix(tail, START)]
                return out
            out.content += text[pos:i]
            j = skip_ws(text, i + len(START))
            if j == len(text):
                return out
            found = scan_call_object(text, j, final) if text[j] == "{" else None
            if found is None or found.error:
                out.content += text[i:]  # not a call after all: the markup is text
                return out
            out.calls.append(found.call)
            if found.end is None:
                return out
            k = skip_ws(text, found.end)
            if text.startswith(END, k):
                pos = k + len(END)
                continue
            if END.startswith(text[k:]):  # the closing tag is still coming (or the model stopped without it)
                return out
            out.calls.pop()
            out.content += text[i:]
            return out

    def format_calls(self, calls):
        return "\n".join(f"{START}\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n{END}"
                         for n, a in calls)
