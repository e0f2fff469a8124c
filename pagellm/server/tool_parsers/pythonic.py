"""Pythonic calls (Llama 3.2/4, ToolACE): the whole reply is a Python list of calls with keyword
arguments, [get_weather(city="Paris"), add(a=1, b=2)]. Arguments are literals, sent as a JSON object."""

from __future__ import annotations

import ast
import json
import re

from pagellm.server.tool_parsers.base import Scan, ToolParser
from pagellm.server.tool_parsers.scan import PartialCall, bracket_end, skip_ws

_NAME = re.compile(r"[A-Za-z_][\w.]*")


def _call_arguments(source: str) -> tuple[str, str] | None:
    """'f(a=1, b="x")' -> ('f', '{"a": 1, "b": "x"}'); None if it is not a call with literal keyword arguments."""
    try:
        node = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
        return None
    try:
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        return ast.unparse(node.func), json.dumps(args, ensure_ascii=False)
    except (ValueError, TypeError, SyntaxError):  # not a literal, or not representable in JSON (a set, bytes)
        return None


def _literal(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    return repr(value)  # str, int, float, bool, None: Python's spelling


class PythonicToolParser(ToolParser):
    name = "pythonic"
    call_format = '[<function-name>(<argument>=<value>, ...), ...] as the whole reply, values as Python literals'

    def scan(self, text: str, final: bool) -> Scan:
        s = skip_ws(text, 0)
        if s == len(text):
            return Scan()
        if text[s] != "[":
            return Scan(content=text)
        out = Scan()
        j = skip_ws(text, s + 1)
        while True:
            if j == len(text):
                return out if not final else Scan(content=text)
            m = _NAME.match(text, j)
            if m is None:
                return Scan(content=text)
            k = skip_ws(text, m.end())
            if k == len(text) or (m.end() == len(text)):
                return out if not final else Scan(content=text)
            if text[k] != "(":
                return Scan(content=text)
            end = bracket_end(text, k, python=True)
            if end is None:
                return out if not final else Scan(content=text)
            parsed = _call_arguments(text[j:end])
            if parsed is None:
                return Scan(content=text)
            # Sent whole once parsed: Python literals have no JSON prefix to stream, and a call that does
            # not parse never reaches the client.
            out.calls.append(PartialCall(*parsed, done=True))
            j = skip_ws(text, end)
            if j == len(text):
                return out if not final else Scan(content=text)
            if text[j] == ",":
                j = skip_ws(text, j + 1)
                continue
            if text[j] != "]":
                return Scan(content=text)
            out.content = text[j + 1:]
            return out

    def format_calls(self, calls):
        def one(name, args):
            if isinstance(args, str):
                args = json.loads(args)
            return f"{name}({', '.join(f'{k}={_literal(v)}' for k, v in args.items())})"

        return "[" + ", ".join(one(n, a) for n, a in calls) + "]"
