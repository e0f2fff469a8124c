"""Chat templates pagellm ships: the tools section for models whose own template ignores `tools`, and
loading `--chat-template` (a file, or the template text itself)."""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagellm.chat_template import compile_template

_DIR = Path(__file__).resolve().parent


def load_chat_template(value: str) -> str:
    """--chat-template: a path to a jinja file, or (as vLLM allows) the template text itself."""
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        try:
            source = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"--chat-template {value}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    elif "{{" in value or "{%" in value:
        source = value
    else:
        raise FileNotFoundError(f"--chat-template {value!r}: no such file (give a jinja file or the template text)")
    try:  # at start-up, not as a 400 blaming each chat request's messages
        compile_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template {value if source is not value else '(text)'}: invalid jinja at line "
                         f"{e.lineno}: {e.message}") from None
    return source


@cache
def _tool_prompt():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    # no HTML escaping: the schemas go into a prompt as written
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    return env.from_string((_DIR / "tool_prompt.jinja").read_text(encoding="utf-8"))


def render_tool_prompt(tools: list[dict], call_format: str, tool_choice: str,
                       parallel_tool_calls: bool = True) -> str:
    return _tool_prompt().render(tools=tools, call_format=call_format, tool_choice=tool_choice,
                                 parallel_tool_calls=parallel_tool_calls).strip()
