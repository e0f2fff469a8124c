"""Request body of POST /v1/responses (OpenAI's Responses API), and its translation to chat messages.

Input is a string or a list of items: messages ({"role", "content"}, content a string or input_text
parts), earlier `function_call`s and their `function_call_output`s. Options pagellm cannot honour are
refused (400 naming the field) rather than accepted and dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagellm.generation_config import given as sampling_default
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.server.fields import Flag, Int
from pagellm.server.protocol_structured import attach


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputText(_Body):
    # output_text: an assistant message replayed from an earlier response's output
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(union_mode="left_to_right")]


class FunctionTool(_Body):
    """Responses API tools are flat: name/description/parameters at the top, not under "function"."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Flag | None = None

    def to_chat_tool(self) -> dict:
        """The chat-completions shape that chat templates and tool-call parsers know."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters or {"type": "object",
                                                                                  "properties": {}}}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class NamedToolChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Flag | None = None


class TextConfig(_Body):
    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: str | None = None


class Reasoning(_Body):
    effort: str | None = None
    summary: str | None = None


LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: Int | None = None
    include: list[str] | None = None
    stream: Flag = False
    store: Flag = True
    previous_response_id: str | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice = "auto"
    parallel_tool_calls: Flag = True
    max_tool_calls: Int | None = None
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: Flag | None = None
    conversation: Any = None
    prompt: Any = None
    user: str | None = None
    # vLLM extras, as on the other generation endpoints
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: Int | None = None
    cache_salt: str | None = None

    def refuse_unsupported(self) -> None:
        """ValueError "FIELD ..." for an option pagellm would otherwise have to drop silently."""
        if self.background:
            raise ValueError("background must be false: pagellm answers every response in the request")
        if self.truncation == "auto":
            raise ValueError("truncation must be 'disabled': pagellm does not drop conversation items to fit "
                             "the context (a prompt that is too long is refused)")
        if self.conversation is not None:
            raise ValueError("conversation requires the Conversations API, which pagellm does not serve; chain "
                             "responses with previous_response_id instead")
        if self.prompt is not None:
            raise ValueError("prompt must be left unset: stored prompt templates are not supported; send input "
                             "and instructions")
        if self.reasoning is not None and (self.reasoning.effort or self.reasoning.summary):
            raise ValueError("reasoning must be left unset: this model has no reasoning mode")
        unknown = [i for i in self.include or () if i != LOGPROBS_INCLUDE]
        if unknown:
            raise ValueError(f"include must list only {LOGPROBS_INCLUDE!r} (the rest needs hosted tools), "
                             f"got {unknown}")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be an integer in [0, 20], got {self.top_logprobs}")
        if self.max_tool_calls is not None and self.max_tool_calls < 1:
            raise ValueError(f"max_tool_calls must be >= 1, got {self.max_tool_calls}")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.name not in {t.name for t in self.tools}:
            raise ValueError(f"tool_choice must name a function in tools; {self.tool_choice.name!r} is not one")
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice requires tools when it is 'required'")

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or self.top_logprobs is not None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.schema_ is None:
            raise ValueError("text requires format.schema when format.type is 'json_schema'")
        return StructuredOutputsParams(json=fmt.schema_)

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        """defaults: the server's sampling defaults for fields the request leaves out (pagellm/generation_config.py)."""
        d = defaults or {}
        try:
            params = SamplingParams(
                temperature=sampling_default(self.temperature, d, "temperature"),
                top_p=sampling_default(self.top_p, d, "top_p"), top_k=sampling_default(self.top_k, d, "top_k"),
                min_p=sampling_default(self.min_p, d, "min_p"),
                repetition_penalty=sampling_default(self.repetition_penalty, d, "repetition_penalty"),
                seed=self.seed, max_tokens=self.max_output_tokens,
                logprobs=(self.top_logprobs or 0) if self.wants_logprobs else None)
            return attach(params, self.structured_outputs(), "text.format.schema")  # the field errors name
        except ValueError as e:
            msg = str(e)
            if msg.startswith("max_tokens "):  # SamplingParams' name for it
                msg = "max_output_tokens" + msg[len("max_tokens"):]
            raise ValueError(msg) from None


def items_to_messages(items: str | list) -> list[dict]:
    """Input items -> chat-template messages (the shape chat completions' messages have).

    A run of function_call items becomes one assistant message with tool_calls, each function_call_output
    a "tool" message, so templates that know tools render the exchange as they were trained to."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages
