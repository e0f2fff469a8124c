"""Tool-call parsers by vLLM's --tool-call-parser names: turn generated text into OpenAI tool calls, whole
(`extract`) or as streaming deltas (`streamer`)."""

from __future__ import annotations

from pagellm.server.tool_parsers.base import Scan, ToolCall, ToolCallStreamer, ToolParser, new_tool_call_id
from pagellm.server.tool_parsers.hermes import HermesToolParser
from pagellm.server.tool_parsers.llama3_json import Llama3JsonToolParser
from pagellm.server.tool_parsers.mistral import JsonArrayToolParser, MistralToolParser
from pagellm.server.tool_parsers.pythonic import PythonicToolParser
from pagellm.server.tool_parsers.scan import PartialCall

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}") from None


__all__ = ["TOOL_PARSERS", "JsonArrayToolParser", "PartialCall", "Scan", "ToolCall", "ToolCallStreamer",
           "ToolParser", "get_tool_parser", "new_tool_call_id"]
