"""Tools in /v1/chat/completions, as vLLM does them.

- The chat template gets `tools`. A template that ignores them (SmolLM2's does) gets them inlined instead:
  a tools section in the system message (chat_templates/tool_prompt.jinja), past calls written in the
  parser's syntax and tool results as user turns in <tool_response> tags, all through the model's own
  template so its special tokens stay right.
- tool_choice "auto" reads calls out of the text with --tool-call-parser (needs --enable-auto-tool-choice);
  "required" and a named function are enforced through structured output: the output is a JSON array of
  {"name", "parameters"} or the named function's arguments, turned into tool_calls afterwards.
- "none" renders the tools but never parses calls.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagellm.chat_template import RESERVED_TEMPLATE_NAMES, flatten_content, template_variables
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.server.chat_templates import render_tool_prompt
from pagellm.server.errors import APIError
from pagellm.server.protocol import ChatCompletionRequest, NamedToolChoice
from pagellm.server.protocol_structured import attach
from pagellm.server.tool_parsers import (
    TOOL_PARSERS,
    JsonArrayToolParser,
    PartialCall,
    Scan,
    ToolCallStreamer,
    ToolParser,
    get_tool_parser,
)
from pagellm.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatSettings:
    """Server-wide chat options (pagellm serve flags)."""

    chat_template: str | None = None  # --chat-template: replaces the model's template
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # --trust-request-chat-template: a request's own chat_template is code the server runs (sandboxed, but
    # a loop can still burn CPU), so as in vLLM it is refused unless the operator allows it.
    trust_request_chat_template: bool = False

    def __post_init__(self):
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser (one of "
                             f"{', '.join(TOOL_PARSERS)})")


class RequiredCallsParser(JsonArrayToolParser):
    """tool_choice "required": the structured output is [{"name": ..., "parameters": {...}}, ...]."""

    name = "required"
    argument_keys = ("parameters",)


class NamedArgumentsParser(ToolParser):
    """A named tool_choice: the structured output is the function's arguments object, the whole text."""

    def __init__(self, function: str):
        self.function = function

    def scan(self, text: str, final: bool) -> Scan:
        return Scan(calls=[PartialCall(self.function, text, final)])


@dataclass
class ToolPlan:
    """What one request does with tools: what the template sees and how the output is read."""

    tools: list[dict] | None = None  # rendered into the prompt
    choice: str = "none"  # "none" | "auto" | "required" | the named function
    parallel: bool = True
    parser: ToolParser | None = None  # None: the output is plain content
    schema: dict | None = None  # required / named: the structured output that enforces it
    history_parser: ToolParser | None = None  # how past calls are written when the template ignores tools

    def apply(self, params: SamplingParams) -> SamplingParams:
        if self.schema is None:
            return params
        if params.structured_outputs is not None:
            raise APIError(400, f"tool_choice {self.choice!r} is enforced through structured output, so it "
                                "cannot be combined with response_format or structured output fields",
                           param="tool_choice")
        # an invalid function schema is then a 400 naming tools (protocol_structured.structured_error)
        return attach(dataclasses.replace(params, extra=dict(params.extra)), StructuredOutputsParams(json=self.schema),
                      "tools")

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A finished choice -> (the assistant message, the finish reason)."""
        if self.parser is None:
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = self.parser.extract(text)
        if not calls:  # a forced call cut before its name ends: what streaming sent (vLLM: "" and no calls)
            return {"role": "assistant", "content": content if self.schema is not None else text}, finish_reason
        if not self.parallel:
            calls = calls[:1]
        message = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}
        return message, _finish(finish_reason)

    def deltas(self) -> ChoiceDeltas:
        return ChoiceDeltas(self)


def _finish(reason: str | None) -> str | None:
    # A call cut by max_tokens keeps "length": the client must see that its arguments are incomplete.
    return "tool_calls" if reason == "stop" else reason


class ChoiceDeltas:
    """One streamed choice: growing text -> chat deltas (content, or tool-call entries)."""

    def __init__(self, plan: ToolPlan):
        self._streamer = plan.parser.streamer() if plan.parser is not None else None
        self._max_calls = None if plan.parallel else 1
        self._sent = 0

    def step(self, text: str, final: bool = False) -> dict | None:
        if self._streamer is None:
            new = text[self._sent:]
            self._sent = len(text)
            return {"content": new} if new else None
        delta = self._streamer.feed(text, final)
        if delta and "tool_calls" in delta and self._max_calls is not None:
            delta["tool_calls"] = [e for e in delta["tool_calls"] if e["index"] < self._max_calls]
            if not delta["tool_calls"]:
                del delta["tool_calls"]
        return delta or None

    def finish(self, text: str, finish_reason: str | None) -> tuple[dict | None, str | None]:
        delta = self.step(text, final=True)
        streamer: ToolCallStreamer | None = self._streamer
        return delta, (_finish(finish_reason) if streamer is not None and streamer.has_calls else finish_reason)


def plan_tools(body: ChatCompletionRequest, settings: ChatSettings) -> ToolPlan:
    tools, choice = body.tools, body.tool_choice
    parallel = body.parallel_tool_calls is not False
    auto_parser = get_tool_parser(settings.tool_call_parser) if settings.tool_call_parser else None
    history = auto_parser or get_tool_parser("hermes")
    if not tools:
        if choice not in (None, "none") and not (choice == "required" and tools == []):
            raise APIError(400, "tool_choice requires tools: send the functions the model may call in tools",
                           param="tool_choice")
        return ToolPlan(history_parser=history)  # an empty tools list with "required" is "none", as OpenAI
    dicts = [t.model_dump(exclude_none=True) for t in tools]
    names = [t.function.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise APIError(400, f"tools must have distinct function names; {dup!r} appears twice", param="tools")
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    plan = ToolPlan(tools=dicts, parallel=parallel, history_parser=history)
    if choice == "none":
        return plan
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not among tools "
                                f"({', '.join(names)})", param="tool_choice")
        plan.choice, plan.parser = name, NamedArgumentsParser(name)
        plan.schema = _parameters(tools[names.index(name)].function.parameters)
        return plan
    if choice == "required":
        plan.choice, plan.parser = "required", RequiredCallsParser()
        plan.schema = _required_schema(tools, parallel)
        return plan
    if not (settings.enable_auto_tool_choice and auto_parser is not None):
        raise APIError(400, '"auto" tool choice (the default when tools are given) requires the server to be '
                            "started with --enable-auto-tool-choice and --tool-call-parser NAME (one of "
                            f"{', '.join(TOOL_PARSERS)}); or send tool_choice \"required\", \"none\" or a "
                            "named function", param="tool_choice")
    plan.choice, plan.parser = "auto", auto_parser
    return plan


def tokenize_plan(tools, settings: ChatSettings) -> ToolPlan:
    """/tokenize with tools: the prompt a chat request with these tools and tool_choice "auto" would get."""
    history = get_tool_parser(settings.tool_call_parser or "hermes")
    dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    return ToolPlan(tools=dicts, choice="auto" if dicts else "none", history_parser=history)


def _parameters(schema: dict | None) -> dict:
    return schema if schema else {"type": "object", "properties": {}}


_DEFS_KEYS = ("$defs", "definitions")  # where a schema keeps what its root-relative "#/$defs/..." refs name


def _required_schema(tools, parallel: bool) -> dict:
    """vLLM's schema for "required": a non-empty array of calls, each naming one tool with its parameters. Each
    tool's $defs / definitions move to the root, where its "#/$defs/X" references resolve once the parameters sit
    deeper (openai.pydantic_function_tool writes them for every nested model); two tools defining one name
    differently are a 400."""
    defs: dict[str, dict] = {}
    calls = []
    for t in tools:
        params = dict(_parameters(t.function.parameters))
        for key in _DEFS_KEYS:
            for name, sub in (params.pop(key, None) or {}).items():
                if defs.setdefault(key, {}).setdefault(name, sub) != sub:
                    raise APIError(400, f"tools: {key}.{name} is defined differently by two tools; with tool_choice "
                                        "\"required\" their definitions must agree", param="tools")
        calls.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def render_prompt(tok: Tokenizer, settings: ChatSettings, messages: list[dict], add_generation_prompt: bool,
                  plan: ToolPlan | None = None, documents: list[dict] | None = None,
                  continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                  chat_template: str | None = None) -> str:
    """Messages (template dicts) -> prompt text through the request's chat_template (if the server trusts
    them), else --chat-template, else the model's template."""
    plan = plan or ToolPlan(history_parser=get_tool_parser(settings.tool_call_parser or "hermes"))
    kwargs = dict(chat_template_kwargs or {})
    clash = sorted(set(kwargs) & set(RESERVED_TEMPLATE_NAMES))
    if clash:
        raise APIError(400, f"chat_template_kwargs must not set {', '.join(clash)}: send them as request fields",
                       param="chat_template_kwargs")
    if chat_template is not None and not settings.trust_request_chat_template:
        raise APIError(400, "chat_template: this server does not run chat templates sent with requests (start "
                            "it with --trust-request-chat-template to allow them)", param="chat_template")
    source = tok.chat_template_source(bool(plan.tools), chat_template or settings.chat_template)
    variables = template_variables(source)
    if documents and "documents" not in variables:
        raise APIError(400, "documents: this model's chat template does not render documents; put them in a "
                            "message instead", param="documents")
    tool_history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if (plan.tools or tool_history) and "tools" not in variables:
        messages = inline_tools(messages, plan)
    return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=plan.tools,
                                   documents=documents, continue_final_message=continue_final_message,
                                   chat_template=source, **kwargs)


def inline_tools(messages: list[dict], plan: ToolPlan) -> list[dict]:
    """Tools, past calls and results written as plain turns, for a template that knows nothing of tools."""
    parser = plan.history_parser or get_tool_parser("hermes")
    out: list[dict] = []
    for m in map(flatten_content, messages):
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = parser.format_calls([(c["function"]["name"], c["function"]["arguments"])
                                         for c in m["tool_calls"]])
            text = m.get("content") or ""
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        elif m["role"] == "tool":
            result = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1]["content"].endswith("</tool_response>"):
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + result}  # parallel results
            else:
                out.append({"role": "user", "content": result})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    if plan.tools:
        section = render_tool_prompt(plan.tools, parser.call_format, plan.choice, plan.parallel)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out
