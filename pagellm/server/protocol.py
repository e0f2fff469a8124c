"""Request bodies of the OpenAI-compatible API (pydantic), and their translation to SamplingParams.

Field names and defaults follow OpenAI's API plus the extras vLLM accepts. Unknown fields are ignored,
as OpenAI does. Range checks are left to SamplingParams, whose errors name the field.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagellm.generation_config import given as sampling_default
from pagellm.sampling_params import SamplingParams
from pagellm.server.fields import Flag, Int, TokenId
from pagellm.server.protocol_structured import StructuredOutputFields, attach


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: Flag | None = False  # null: the default (OpenAI's SDKs send it)
    continuous_usage_stats: Flag | None = False  # vLLM: with include_usage, every chunk carries usage so far


class _SamplingRequest(StructuredOutputFields, _Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # Unknown fields are kept (not ignored) so that the server refuses, naming it, any field OpenAI or
    # vLLM define that pagellm cannot honour (server/request_checks.py); others are still accepted.
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    n: Int = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: Flag = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int = 0
    ignore_eos: Flag = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: Flag = False
    skip_special_tokens: Flag = True
    cache_salt: str | None = None  # requests with different salts never share prefix-cache blocks
    use_beam_search: Flag = False
    length_penalty: float = 1.0  # beam search: a sequence scores sum(logprob) / length ** length_penalty
    allowed_token_ids: list[TokenId] | None = None  # only these ids may be sampled
    bad_words: list[str] | None = None  # never generated (vLLM's token-sequence semantics)
    truncate_prompt_tokens: Int | None = None  # keep the last N prompt tokens (-1: as many as fit)
    return_tokens_as_token_ids: Flag | None = None  # logprob tokens as "token_id:N"; None: the server flag
    prompt_logprobs: Int | None = None  # vLLM: logprob + top-N of every prompt token (not with stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           beam_width: int | None = None, defaults: dict | None = None) -> SamplingParams:
        """defaults: the server's sampling defaults for fields the request leaves out (pagellm/generation_config.py)."""
        if self.use_beam_search:
            return self._beam_search_params(max_tokens, logprobs, beam_width)
        bias = None
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                if not isinstance(key, str) or not re.fullmatch(r"-?[0-9]+", key):  # int() also takes '1_000'
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
                bias[int(key)] = value

        def given(value, default):
            return default if value is None else value

        d = defaults or {}
        return attach(SamplingParams(
            n=self.n, temperature=sampling_default(self.temperature, d, "temperature"),
            top_p=sampling_default(self.top_p, d, "top_p"), top_k=sampling_default(self.top_k, d, "top_k"),
            min_p=sampling_default(self.min_p, d, "min_p"), seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, max_tokens=max_tokens, min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, logprobs=logprobs,
            presence_penalty=given(self.presence_penalty, 0.0),
            frequency_penalty=given(self.frequency_penalty, 0.0),
            repetition_penalty=sampling_default(self.repetition_penalty, d, "repetition_penalty"), logit_bias=bias,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words, truncate_prompt_tokens=self.truncate_prompt_tokens),
            *self.structured_outputs_params())

    def _beam_search_params(self, max_tokens: int | None, logprobs: int | None,
                            beam_width: int | None) -> SamplingParams:
        """vLLM's beam search: n sequences returned out of beam_width (best_of, else n) beams. The search
        ranks whole sequences by log-probability, so a sampling option it would silently drop is refused."""
        if self.stream:
            raise ValueError("stream must be false with use_beam_search: the beams are ranked only when the "
                             "search ends, so there is nothing to stream before the final result")
        ignored = {"temperature": self.temperature not in (None, 0), "top_p": self.top_p not in (None, 1),
                   "top_k": self.top_k not in (None, -1, 0), "min_p": self.min_p not in (None, 0),
                   "presence_penalty": self.presence_penalty not in (None, 0),
                   "frequency_penalty": self.frequency_penalty not in (None, 0),
                   "repetition_penalty": self.repetition_penalty not in (None, 1),
                   "logit_bias": bool(self.logit_bias), "stop": bool(self.stop),
                   "stop_token_ids": bool(self.stop_token_ids), "min_tokens": self.min_tokens != 0,
                   "allowed_token_ids": self.allowed_token_ids is not None, "bad_words": bool(self.bad_words),
                   "logprobs": logprobs is not None}
        for name, set_ in ignored.items():
            if set_:
                raise ValueError(f"{name} must be left unset with use_beam_search (beam search does not "
                                 f"apply it)")
        return attach(SamplingParams(
            n=self.n, use_beam_search=True, beam_width=beam_width or self.n, length_penalty=self.length_penalty,
            temperature=0.0, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, truncate_prompt_tokens=self.truncate_prompt_tokens),
            *self.structured_outputs_params())


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: Flag = False
    add_special_tokens: Flag = True  # vLLM: the tokenizer's BOS etc. on text prompts
    suffix: str | None = None
    best_of: Int | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class FunctionDefinition(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: the function takes no arguments
    strict: Flag | None = None


class ChatTool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ToolCallFunction(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; some clients send the object


class AssistantToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: which call this is the result of

    def to_template_dict(self) -> dict:
        # Chat templates know "system"; "developer" is OpenAI's newer name for it.
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.content if self.content is not None else ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            # Templates write `arguments | tojson`: they expect the object, not OpenAI's JSON string.
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": _arguments_object(c.function.arguments)}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


def _arguments_object(arguments: str | dict) -> dict:
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        raise ValueError(f"tool_calls[].function.arguments must be a JSON object, got {arguments!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"tool_calls[].function.arguments must be a JSON object, got {arguments!r}")
    return value


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: Flag = False
    top_logprobs: Int | None = None
    add_generation_prompt: Flag = True
    # tools (pagellm/server/serving_chat_tools.py)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Flag | None = True
    # vLLM's templating extras
    continue_final_message: Flag = False
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # this request's template (needs --trust-request-chat-template)
    add_special_tokens: Flag = False  # the tokenizer's BOS etc. on top of the template's (vLLM's default)

    def engine_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs requires logprobs to be true")
            return None
        k = self.top_logprobs or 0
        if not 0 <= k <= 20:
            raise ValueError(f"top_logprobs must be an integer in [0, 20], got {k}")
        return k


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Flag | None = None  # default: true for a prompt, false for messages (as vLLM)
    add_generation_prompt: Flag = True
    return_token_strs: Flag = False
    # messages only: the chat request's templating fields, so the count matches what it would be sent
    tools: list[ChatTool] | None = None
    continue_final_message: Flag = False
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None

    def chat_only_fields(self) -> list[str]:
        """The messages-only fields this request sets (refused with a prompt rather than ignored)."""
        names = ("tools", "continue_final_message", "documents", "chat_template_kwargs", "chat_template")
        return [n for n in names if getattr(self, n)]


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]
