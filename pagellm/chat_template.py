"""Chat templates: rendering messages to a prompt in a jinja2 sandbox, as transformers' templates expect.

Templates come from the model's files, `--chat-template FILE` or a request's `chat_template` field, so the
environment is jinja2's `ImmutableSandboxedEnvironment`: no attribute starting with `_`, no mutation of
the objects handed in, no file or module access (there is no loader and nothing but plain data and the
helpers below in the context).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names the renderer passes to the template itself; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_NAMES = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                           "chat_template")


def render_messages(source: str, messages: list[dict], *, special_tokens: dict[str, str],
                    add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    documents: list[dict] | None = None, continue_final_message: bool = False,
                    **kwargs) -> str:
    """Render messages with the template `source`; extra kwargs (chat_template_kwargs) reach the template.
    continue_final_message leaves the last message open for generation to continue it (as transformers)."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: one "
                         "continues the last message, the other opens a new one")
    flat = [flatten_content(m) for m in messages]
    try:
        text = compile_template(source).render(
            messages=flat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
            **{**special_tokens, **kwargs})
    except (jinja2.TemplateError, MemoryError, RecursionError):
        raise
    except Exception as e:
        # A template's own expression failed (`x.__globals__.y` is an AttributeError on jinja's Undefined,
        # `{% include %}` a TypeError without a loader, 1/0, ...): one error type for every caller, so the
        # server answers 400 naming it rather than 500.
        raise jinja2.TemplateRuntimeError(f"{type(e).__name__}: {e}") from e
    if continue_final_message:
        text = _cut_after_final_message(text, flat)
    return text


def _cut_after_final_message(text: str, messages: list[dict]) -> str:
    final = (messages[-1].get("content") or "") if messages else ""
    if not final.strip():
        raise ValueError("continue_final_message needs a final message with content to continue")
    at = text.rfind(final.strip())
    if at == -1:
        raise ValueError("continue_final_message: the chat template does not render the final message's "
                         "content verbatim, so there is no place to continue it from")
    kept = text[at:at + len(final.lstrip())] == final.lstrip()  # the template kept its trailing whitespace
    return text[:at + len(final.lstrip() if kept else final.strip())]


def flatten_content(message: dict) -> dict:
    """A message whose content is a list of text parts, with the parts joined (templates expect a string)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text":
            if not isinstance(part.get("text"), str):  # OpenAI: a 400 for a part without its text
                raise ValueError(f"a text content part needs a string 'text', got {part.get('text')!r}")
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"unsupported message content part of type {kind!r} (only text is supported)")
    return dict(message, content="\n".join(texts))


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (training-mask markers in some templates) renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters, which changes prompts.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# Bounded: a request may bring its own template (`chat_template`), so sources are not a fixed set.
@functools.lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """The sandboxed template for `source`, compiled once while it stays among the 64 latest."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


@functools.lru_cache(maxsize=64)
def template_variables(source: str) -> frozenset[str]:
    """The names a template reads from its context (e.g. whether it renders `tools` at all)."""
    env = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
