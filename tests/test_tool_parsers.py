"""Tool-call parsers on fixed strings: what `extract` finds in a finished text, and that the streaming deltas
of the same text (fed character by character and in random chunks) add up to exactly that."""

import json
import random

import pytest

from pagellm.server.tool_parsers import TOOL_PARSERS, get_tool_parser

pytestmark = pytest.mark.timeout(60)  # pure Python on short strings

# ---- parsers on fixed strings ------------------------------------------------------------------------

CASES = {  # parser -> [(text, expected content, expected [(name, arguments object)])]
    "hermes": [
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>{"arguments": {"a": 1, "b": [2, "}"]}, "name": "add"}</tool_call>',
         "Let me check.", [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": [2, "}"]})]),
        ('<tool_call>{"name": "f"}</tool_call>', None, [("f", {})]),
        ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("f", {"x": 1})]),
        ('<tool_call>{"name": "f", "arguments": {"x": 1}}', None, [("f", {"x": 1})]),  # stopped before the tag
        ("plain <tool text, no call", "plain <tool text, no call", []),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ],
    "llama3_json": [
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "add", "parameters": '
         '{"a": 2, "b": 3}}', None, [("get_weather", {"city": "Rome"}), ("add", {"a": 2, "b": 3})]),
        ('{"name": "f", "parameters": {"q": "a \\"quoted\\" word"}}', None, [("f", {"q": 'a "quoted" word'})]),
        ('{"result": 2} is the answer', '{"result": 2} is the answer', []),
        ("Hello there", "Hello there", []),
    ],
    "mistral": [
        ('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", '
         '"arguments": {"a": 1, "b": 4}}]', "Sure.", [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 4})]),
        ('[{"name": "f", "arguments": {"x": null}}]', None, [("f", {"x": None})]),  # marker skipped as special
        ("[TOOL_CALLS] is a marker", "[TOOL_CALLS] is a marker", []),
        ("[1] a citation", "[1] a citation", []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris"), add(a=1, b=3)]', None, [("get_weather", {"city": "Paris"}),
                                                            ("add", {"a": 1, "b": 3})]),
        ("[f(x=[1, {'k': None}], y=True, s='it\\'s')]", None, [("f", {"x": [1, {"k": None}], "y": True,
                                                                     "s": "it's"})]),
        ("[1, 2] are numbers", "[1, 2] are numbers", []),
        ("[f(1)]", "[f(1)]", []),  # positional arguments have no names: not a call
    ],
}


def _stream(parser, text: str, cuts: list[int]):
    """Feed growing prefixes; return (content, {index: [name, arguments, id]}, every delta)."""
    streamer, deltas = parser.streamer(), []
    for cut in cuts:
        d = streamer.feed(text[:cut])
        if d:
            deltas.append(d)
    d = streamer.feed(text, final=True)
    if d:
        deltas.append(d)
    calls: dict[int, list] = {}
    for d in deltas:
        for e in d.get("tool_calls", []):
            if e["index"] not in calls:
                assert set(e) == {"index", "id", "type", "function"} and e["type"] == "function", e
                assert e["id"].startswith("chatcmpl-tool-") and e["index"] == len(calls)
                calls[e["index"]] = [e["function"]["name"], "", e["id"]]
            else:
                assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}, e
            calls[e["index"]][1] += e["function"]["arguments"]
    return "".join(d.get("content", "") for d in deltas), calls, deltas


@pytest.mark.parametrize("name", sorted(CASES))
def test_parsers_extract_and_stream_the_same_calls(name):
    parser = get_tool_parser(name)
    rng = random.Random(0)
    for text, content, expected in CASES[name]:
        got_content, calls = parser.extract(text)
        assert got_content == content, text
        assert [(c.name, json.loads(c.arguments)) for c in calls] == expected, text
        assert all(c.id.startswith("chatcmpl-tool-") for c in calls)
        # Character by character, and in random chunks: the deltas add up to the same reply.
        for cuts in (list(range(1, len(text))), sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))):
            s_content, s_calls, deltas = _stream(parser, text, cuts)
            assert s_content == (content or ""), (text, cuts)
            assert [(n, a) for n, a, _ in s_calls.values()] == [(c.name, c.arguments) for c in calls], text
            if expected:  # markup never leaks into the content
                assert not any(m in s_content for m in ("<tool_call", "[TOOL_CALLS", '{"name"', "get_weather("))


def test_streamed_arguments_arrive_in_fragments_after_the_name():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 12}}\n</tool_call>'
    _, calls, deltas = _stream(get_tool_parser("hermes"), text, list(range(1, len(text))))
    first = next(d for d in deltas if "tool_calls" in d)["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    fragments = [e["function"]["arguments"] for d in deltas for e in d.get("tool_calls", []) if "id" not in e]
    assert len(fragments) > 5 and "".join(fragments) == '{"city": "Paris", "days": 12}'
    # Junk after a well-formed call makes the block text; a stream has sent the call by then (the one
    # documented difference between the two paths).
    junk = '<tool_call>{"name": "f", "arguments": {}} junk</tool_call>'
    assert get_tool_parser("hermes").extract(junk) == (junk, [])
    # "<tool" alone is held back, and released as content once it turns out not to be a call
    streamer = get_tool_parser("hermes").streamer()
    assert streamer.feed("Hi <tool") == {"content": "Hi"}
    assert streamer.feed("Hi <tools are nice") == {"content": " <tools are nice"}


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_format_calls_round_trips_through_extract(name):
    parser = get_tool_parser(name)
    calls = [("get_weather", {"city": "Paris", "unit": None}), ("add", {"a": 1, "b": [2.5, True, "x'y\""]})]
    content, parsed = parser.extract(parser.format_calls(calls))
    assert content is None and [(c.name, json.loads(c.arguments)) for c in parsed] == calls
