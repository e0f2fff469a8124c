"""Tool calling: planning (tool_choice), templating of tools and tool turns, and the HTTP flow through the
official openai client and LangChain on a tiny random Llama. The parsers: tests/test_tool_parsers.py.

A random model never writes a tool call by itself, so the HTTP tests force the text: "required" and named
choices are forced by the server itself (structured output), and "auto" is fed a hermes call through a
structured-output regex, then parsed as any generated text would be.
"""

import asyncio
import json

import httpx
import openai
import pytest
from test_server import Server

from pagellm.server.errors import APIError
from pagellm.server.protocol import ChatCompletionRequest
from pagellm.server.serving_chat_tools import ChatSettings, plan_tools, render_prompt
from pagellm.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(240)

MODEL = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "enum": [1, 2]},
                                                                   "b": {"type": "integer", "enum": [3, 4]}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# ---- planning and templating (no server) ---------------------------------------------------------------

AUTO = ChatSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")


def _body(**kw):
    return ChatCompletionRequest.model_validate({"messages": ASK, **kw})


def _error(fn) -> APIError:
    with pytest.raises(APIError) as e:
        fn()
    assert e.value.status == 400
    return e.value


def test_tool_choice_validation_and_schemas():
    e = _error(lambda: plan_tools(_body(tools=TOOLS, tool_choice={"type": "function",
                                                                   "function": {"name": "nope"}}), AUTO))
    assert e.param == "tool_choice" and "nope" in e.message and "get_weather" in e.message
    e = _error(lambda: plan_tools(_body(tools=TOOLS), ChatSettings()))  # "auto" by default
    assert e.param == "tool_choice" and "--enable-auto-tool-choice" in e.message and "--tool-call-parser" in e.message
    assert _error(lambda: plan_tools(_body(tool_choice="required"), AUTO)).param == "tool_choice"
    assert _error(lambda: plan_tools(_body(tools=[WEATHER, WEATHER]), AUTO)).param == "tools"
    assert plan_tools(_body(tools=[], tool_choice="required"), AUTO).parser is None  # OpenAI: like "none"
    none = plan_tools(_body(tools=TOOLS, tool_choice="none"), ChatSettings())
    assert none.parser is None and none.tools and none.schema is None
    named = plan_tools(_body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}), AUTO)
    assert named.schema == ADD["function"]["parameters"]
    required = plan_tools(_body(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), AUTO)
    assert required.schema["type"] == "array" and required.schema["minItems"] == 1 == required.schema["maxItems"]
    assert [a["properties"]["name"]["enum"] for a in required.schema["items"]["anyOf"]] == [["get_weather"], ["add"]]
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ChatSettings(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="hermes"):
        ChatSettings(tool_call_parser="nope")


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and 1+3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "4"},
]


@pytest.fixture(scope="module")
def smollm_tokenizer(smollm_gguf_path):
    return Tokenizer.from_path(smollm_gguf_path)


def test_smollm_template_ignores_tools_so_they_are_inlined(smollm_tokenizer):
    body = ChatCompletionRequest.model_validate({"messages": CONVERSATION, "tools": TOOLS})
    text = render_prompt(smollm_tokenizer, AUTO, [m.to_template_dict() for m in body.messages], True,
                         plan_tools(body, AUTO))
    assert text.startswith("<|im_start|>system\nYou may call one or more functions")
    assert json.dumps(WEATHER["function"]) in text and json.dumps(ADD["function"]) in text
    assert "<tool_call>\n{\"name\": <function-name>" in text  # the hermes parser's syntax is explained
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}\n<tool_call>" in text
    # both results in one user turn (the template knows no "tool" role), then the assistant's turn
    assert text.endswith("<|im_start|>user\n<tool_response>\n{\"temp_c\": 21}\n</tool_response>\n"
                         "<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


NATIVE_TEMPLATE = (
    "{% if tools %}TOOLS={{ tools | map(attribute='function') | map(attribute='name') | join(',') }}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }};{% endfor %}"
    "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
    "{% if documents %}DOCS={{ documents | length }}{{ '\\n' }}{% endif %}{{ flavour | default('') }}"
    "{% if add_generation_prompt %}[assistant]{% endif %}")


def test_a_tool_aware_template_renders_them_itself(smollm_tokenizer):
    settings = ChatSettings(chat_template=NATIVE_TEMPLATE)  # --chat-template
    body = ChatCompletionRequest.model_validate({"messages": CONVERSATION, "tools": TOOLS, "tool_choice": "none"})
    msgs = [m.to_template_dict() for m in body.messages]
    text = render_prompt(smollm_tokenizer, settings, msgs, True, plan_tools(body, settings),
                         documents=[{"title": "a", "text": "b"}], chat_template_kwargs={"flavour": "X"})
    assert text == ('TOOLS=get_weather,add\n[user]Weather in Paris and 1+3?\n'
                    '[assistant]CALL get_weather {"city": "Paris"};CALL add {"a": 1, "b": 3};\n'
                    '[tool]{"temp_c": 21}(for call_1)\n[tool]4(for call_2)\nDOCS=1\nX[assistant]')
    e = _error(lambda: render_prompt(smollm_tokenizer, settings, msgs, True, chat_template_kwargs={"tools": []}))
    assert e.param == "chat_template_kwargs"
    e = _error(lambda: render_prompt(smollm_tokenizer, ChatSettings(), msgs, True, documents=[{"text": "b"}]))
    assert e.param == "documents"


def test_continue_final_message(smollm_tokenizer):
    msgs = [*ASK, {"role": "assistant", "content": "The weather in Paris is"}]
    text = render_prompt(smollm_tokenizer, ChatSettings(), msgs, False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe weather in Paris is")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        render_prompt(smollm_tokenizer, ChatSettings(), msgs, True, continue_final_message=True)


# ---- HTTP: the real server, the official client, LangChain ------------------------------------------------

@pytest.fixture(scope="module")
def tiny_path(tiny_hf_model):
    return tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def server(tiny_path, smollm_gguf_path, tmp_path_factory):
    with Server.running(["--model", tiny_path, "--tokenizer", smollm_gguf_path, "--served-model-name", MODEL,
                         "--kv-cache-memory", "16MiB", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                        tmp_path_factory.mktemp("srv") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _accumulate(stream):
    """Stream chunks -> (content, [(id, name, arguments)], finish_reason, usage, logprob count)."""
    content, calls, finish, use, n_lps = "", {}, None, None, 0
    for chunk in stream:
        use = chunk.usage or use
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.type == "function" and tc.function.name
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                else:
                    assert tc.id is None and not tc.function.name
                calls[tc.index][2] += tc.function.arguments or ""
            if ch.logprobs and ch.logprobs.content:
                n_lps += len(ch.logprobs.content)
            finish = ch.finish_reason or finish
    return content, [tuple(c) for c in calls.values()], finish, use, n_lps


def _check_calls(calls, allowed=("get_weather", "add"), finish_reason="tool_calls"):
    assert calls and finish_reason in ("tool_calls", "length")
    if finish_reason == "length":  # cut by max_tokens: the last call's arguments may be incomplete
        calls = calls[:-1]
    for _, name, arguments in calls:
        args = json.loads(arguments)
        assert name in allowed
        assert args == {"city": args["city"]} and args["city"] in ("Paris", "Rome") if name == "get_weather" \
            else set(args) == {"a", "b"}


def test_named_tool_choice_is_enforced(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                       temperature=0.0, max_tokens=40, logprobs=True)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    _check_calls([(call.id, call.function.name, call.function.arguments)], ("get_weather",))
    assert len(c.logprobs.content) == r.usage.completion_tokens > 0  # logprobs and usage still work
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                            temperature=0.0, max_tokens=40, stream=True, logprobs=True,
                                            stream_options={"include_usage": True})
    content, calls, finish, use, n_lps = _accumulate(stream)
    assert content == "" and finish == "tool_calls"
    assert [(n, a) for _, n, a in calls] == [(call.function.name, call.function.arguments)]
    assert use.completion_tokens == r.usage.completion_tokens == n_lps


def test_required_tool_choice_gives_calls_sync_async_and_streaming(client, server):
    # A random model may go on adding calls to the array until max_tokens: both endings are checked.
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60, seed=3,
              temperature=1.0)
    r = client.chat.completions.create(**kw, n=4)
    for c in r.choices:
        assert c.message.content is None
        _check_calls([(t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls],
                     finish_reason=c.finish_reason)
    content, calls, finish, _, _ = _accumulate(client.chat.completions.create(**kw, stream=True))
    assert content == ""
    _check_calls(calls, finish_reason=finish)
    # parallel_tool_calls=False: exactly one call (maxItems 1), so the array always closes
    kw["parallel_tool_calls"] = False
    single = client.chat.completions.create(**kw).choices[0]
    assert single.finish_reason == "tool_calls" and len(single.message.tool_calls) == 1
    _check_calls([(t.id, t.function.name, t.function.arguments) for t in single.message.tool_calls])

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        try:
            return await aclient.chat.completions.create(**kw)
        finally:
            await aclient.close()

    same = asyncio.run(run())  # same seed, same calls
    expected = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert [(t.function.name, t.function.arguments) for t in same.choices[0].message.tool_calls] == \
           [(t.function.name, t.function.arguments) for t in expected]


def test_required_tool_choice_with_nested_models_in_defs(client):
    """openai.pydantic_function_tool writes $defs for a nested model, referenced as "#/$defs/Inner"; under
    "required" the tool's parameters sit deeper in the combined schema, so its definitions move to the root
    (vLLM's); it had been a 400 "Cannot find field '$defs'". Two tools defining one name differently: a 400."""
    from pydantic import BaseModel

    class Inner(BaseModel):
        n: int

    class Outer(BaseModel):
        inner: Inner

    tool = openai.pydantic_function_tool(Outer)
    assert "$defs" in tool["function"]["parameters"]
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[tool], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=60, temperature=0.0)
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "Outer" and isinstance(args["inner"]["n"], int)
    other = json.loads(json.dumps(tool))
    other["function"]["name"] = "Other"
    other["function"]["parameters"]["$defs"]["Inner"]["properties"]["n"] = {"type": "string"}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[tool, other], tool_choice="required",
                                       max_tokens=5)
    assert e.value.body["param"] == "tools" and "$defs.Inner is defined differently" in e.value.body["message"]


def test_a_required_call_cut_before_its_name_ends_streams_and_returns_alike(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=3, temperature=0.0)
    c = client.chat.completions.create(**kw).choices[0]
    assert (c.message.content, c.message.tool_calls, c.finish_reason) == ("", None, "length")  # was the raw JSON
    content, calls, finish, _, _ = _accumulate(client.chat.completions.create(**kw, stream=True))
    assert (content, calls, finish) == ("", [], "length")


HERMES_CALL = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n'
               r'</tool_call>')


def test_auto_parses_a_hermes_call_from_the_text(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=60,
              extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Checking."
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    content, calls, finish, _, _ = _accumulate(client.chat.completions.create(**kw, stream=True))
    assert (content, finish) == ("Checking.", "tool_calls")
    assert [(n, a) for _, n, a in calls] == [(call.function.name, call.function.arguments)]
    # tool_choice "none": the same text stays content
    none = client.chat.completions.create(**kw, tool_choice="none").choices[0]
    assert none.message.tool_calls is None and none.finish_reason == "stop"
    assert none.message.content.startswith("Checking.\n<tool_call>")
    # no call in the text: plain content, as without tools
    plain = client.chat.completions.create(**{**kw, "extra_body": {"structured_outputs": {"regex": "Hello!"}}})
    assert plain.choices[0].message.content == "Hello!" and plain.choices[0].message.tool_calls is None


def test_multi_turn_with_tool_results_and_bad_requests(client):
    r = client.chat.completions.create(model=MODEL, messages=CONVERSATION, tools=TOOLS, tool_choice="none",
                                       temperature=0.0, max_tokens=5)
    assert r.choices[0].message.tool_calls is None and r.usage.prompt_tokens > 100
    bad = [dict(tool_choice={"type": "function", "function": {"name": "nope"}}),
           dict(tool_choice="required", tools=openai.NOT_GIVEN),
           dict(tools=[WEATHER, WEATHER])]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 5,
                                              **kw})
        assert e.value.body["param"] in ("tool_choice", "tools"), kw
    broken = [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]
    with pytest.raises(openai.BadRequestError, match="arguments"):
        client.chat.completions.create(model=MODEL, messages=broken, max_tokens=5)


def test_langchain_bind_tools_returns_tool_calls(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=40,
                     max_retries=0)
    message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Rome") and call["id"]
    message = llm.bind_tools(TOOLS, tool_choice="required").invoke("Add 1 and 3")
    assert message.tool_calls and {c["name"] for c in message.tool_calls} <= {"get_weather", "add"}


@pytest.fixture(scope="module")
def plain_server(tiny_path, smollm_gguf_path, tmp_path_factory):
    """No --enable-auto-tool-choice; --chat-template replaces the model's template."""
    template = tmp_path_factory.mktemp("tpl") / "tools.jinja"
    template.write_text(NATIVE_TEMPLATE)
    with Server.running(["--model", tiny_path, "--tokenizer", smollm_gguf_path, "--served-model-name", MODEL,
                         "--kv-cache-memory", "16MiB", "--chat-template", str(template)],
                        tmp_path_factory.mktemp("srv2") / "server.log") as s:
        yield s


def test_auto_needs_the_server_flag_and_chat_template_overrides(plain_server, smollm_tokenizer):
    client = openai.OpenAI(base_url=plain_server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice") as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=5)
    assert e.value.body["param"] == "tool_choice"
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"flavour": "spicy"}})
    expected = f"TOOLS=get_weather,add\n[user]{ASK[0]['content']}\nspicy[assistant]"
    assert r.usage.prompt_tokens == len(smollm_tokenizer.encode(expected, add_special_tokens=False))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_an_invalid_function_schema_names_tools(server, choice):
    """tool_choice required / named is enforced through structured output: its error names the request's tools,
    not the internal structured_outputs.json."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "tools": tools,
        "tool_choice": choice})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert r.json()["error"]["message"].startswith("tools: ") and "structured_outputs" not in r.text
