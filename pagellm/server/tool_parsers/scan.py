"""Scanning model text that may stop anywhere: where a JSON (or Python) value ends, or that it has not
ended yet. Only brackets and strings are matched here; json.loads / ast validate a finished value.

Every function returns None for "the text ends before this does", so a streaming caller can wait for
more text and a final caller can treat the value as cut off.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\r\n"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int, quote: str = '"') -> int | None:
    """End (exclusive) of the string literal opening at text[i]."""
    j = i + 1
    while j < len(text):
        ch = text[j]
        if ch == "\\":
            j += 2
        elif ch == quote:
            return j + 1
        else:
            j += 1
    return None


def python_string_end(text: str, i: int) -> int | None:
    quote = text[i]
    if text.startswith(quote * 3, i):
        end = text.find(quote * 3, i + 3)
        while end != -1 and text[end - 1] == "\\":
            end = text.find(quote * 3, end + 1)
        return None if end == -1 else end + 3
    return string_end(text, i, quote)


def bracket_end(text: str, i: int, python: bool = False) -> int | None:
    """End (exclusive) of the bracketed value opening at text[i] ({, [ or ( ), strings skipped."""
    depth = 0
    j = i
    while j < len(text):
        ch = text[j]
        if ch == '"' or (python and ch == "'"):
            e = python_string_end(text, j) if python else string_end(text, j)
            if e is None:
                return None
            j = e
            continue
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def value_end(text: str, i: int, final: bool) -> int | None:
    """End (exclusive) of the JSON value starting at text[i]. A bare scalar at the very end of the text
    may still grow (1 -> 12, tr -> true), so it ends there only when the text is final."""
    ch = text[i]
    if ch == '"':
        return string_end(text, i)
    if ch in "{[":
        return bracket_end(text, i)
    j = i
    while j < len(text) and text[j] not in ",}]" + WHITESPACE:
        j += 1
    return j if j < len(text) or final else None


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (it may become the marker)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass
class PartialCall:
    """A tool call as far as the text goes. `arguments` only ever grows while the text grows."""

    name: str | None = None
    arguments: str = ""
    done: bool = False


@dataclass
class CallScan:
    call: PartialCall
    end: int | None  # end of the call object; None: the text ends inside it
    error: bool = False


NAME_KEYS = ("name",)
ARGUMENT_KEYS = ("arguments", "parameters")


def scan_call_object(text: str, i: int, final: bool, argument_keys=ARGUMENT_KEYS) -> CallScan:
    """Read {"name": ..., "arguments": {...}} (keys in any order) starting at text[i] == "{".

    Object arguments are exposed raw while they stream (the model's own JSON text, so what was streamed
    equals what a non-streaming reply carries); any other value (a JSON-encoded string, null) appears
    whole once finished."""
    call = PartialCall()
    n = len(text)
    bad = CallScan(call, None, error=True)
    j = skip_ws(text, i + 1)
    seen_args = False
    while True:
        if j == n:
            return CallScan(call, None)
        if text[j] == "}" and j == skip_ws(text, i + 1):
            return bad  # {} names no function
        if text[j] != '"':
            return bad
        key_end = string_end(text, j)
        if key_end is None:
            return CallScan(call, None)
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j == n:
            return CallScan(call, None)
        if text[j] != ":":
            return bad
        j = skip_ws(text, j + 1)
        if j == n:
            return CallScan(call, None)
        end = value_end(text, j, final)
        if key in argument_keys and not seen_args:
            raw = text[j:end if end is not None else n]
            if end is None:
                if raw[0] in "{[":
                    call.arguments = raw
                return CallScan(call, None)
            seen_args = True
            try:
                value = json.loads(raw)
            except ValueError:
                return bad
            call.arguments = raw if raw[0] in "{[" else ("{}" if value is None else
                                                         value if isinstance(value, str) else raw)
        elif key in NAME_KEYS:
            if end is None:
                return CallScan(call, None)
            try:
                name = json.loads(text[j:end])
            except ValueError:
                return bad
            if not isinstance(name, str) or not name:
                return bad
            call.name = name
        if end is None:
            return CallScan(call, None)
        j = skip_ws(text, end)
        if j == n:
            return CallScan(call, None)
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        if text[j] != "}":
            return bad
        if call.name is None:
            return bad
        if not seen_args:
            call.arguments = "{}"
        call.done = True
        return CallScan(call, j + 1)
