"""POST /v1/responses (OpenAI's Responses API) through the official openai client, on a real server with the
tiny random Llama (SmolLM2's tokenizer): at temperature 0 every response equals the chat completion of the
same conversation, streamed or not, chained with previous_response_id or not."""

import asyncio
import json

import httpx
import openai
import pytest
from test_server import MODEL, Server

pytestmark = pytest.mark.timeout(240)

GREEDY = dict(temperature=0.0)
FLAG_TOOL = {"type": "function", "name": "set_flag", "description": "Set the flag.",
             "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}}


@pytest.fixture(scope="module")
def server(tiny_hf_model, smollm_gguf_path, tmp_path_factory):
    path = tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024)
    with Server.running(["--model", path, "--tokenizer", smollm_gguf_path, "--served-model-name", MODEL,
                         "--kv-cache-memory", "16MiB"], tmp_path_factory.mktemp("responses") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat_text(client, messages, max_tokens) -> tuple[str, object]:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, **GREEDY)
    return r.choices[0].message.content, r.usage


def test_text_input_with_instructions_equals_chat(client):
    r = client.responses.create(model=MODEL, input="Name a colour.", instructions="Answer in one word.",
                                max_output_tokens=9, **GREEDY)
    text, usage = chat_text(client, [{"role": "system", "content": "Answer in one word."},
                                     {"role": "user", "content": "Name a colour."}], 9)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == text and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert r.usage.total_tokens == usage.total_tokens
    # A random model never stops on its own in 9 tokens: the response says max_output_tokens cut it.
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.instructions == "Answer in one word." and r.max_output_tokens == 9


def test_message_items_with_parts_and_developer_role_equal_chat(client):
    items = [{"role": "developer", "content": "Be terse."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello, "},
                                                              {"type": "input_text", "text": "world"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
             {"role": "user", "content": "Again?"}]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=6, **GREEDY)
    text, _ = chat_text(client, [{"role": "system", "content": "Be terse."},
                                 {"role": "user", "content": "Hello, world"},
                                 {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again?"}], 6)
    assert r.output_text == text


def test_streaming_events_in_order_and_equal_to_the_whole_response(server, client):
    whole = client.responses.create(model=MODEL, input="Stream me", max_output_tokens=7, **GREEDY)
    events = list(client.responses.create(model=MODEL, input="Stream me", max_output_tokens=7, stream=True,
                                          **GREEDY))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and deltas
    assert types[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert "".join(d.delta for d in deltas) == whole.output_text == events[-1].response.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == whole.output_text and done.item_id == events[-1].response.output[0].id
    # On the wire each event is an `event:` line naming the type its data carries.
    with httpx.stream("POST", server.url + "/v1/responses", timeout=60,
                      json={"model": MODEL, "input": "Stream me", "max_output_tokens": 3, "stream": True}) as r:
        blocks = [b for b in r.read().decode().split("\n\n") if b.strip()]
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line[6:])["type"] == event_line[7:]
    assert "[DONE]" not in blocks[-1]


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Be kind.",
                                    max_output_tokens=5, **GREEDY)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=5, **GREEDY)
    # OpenAI does not carry the earlier instructions over: only input and output.
    text, usage = chat_text(client, [{"role": "user", "content": "My name is Ada."},
                                     {"role": "assistant", "content": first.output_text},
                                     {"role": "user", "content": "What is my name?"}], 5)
    assert second.output_text == text and second.usage.input_tokens == usage.prompt_tokens
    assert second.previous_response_id == first.id
    third = client.responses.create(model=MODEL, input="And now?", previous_response_id=second.id,
                                    max_output_tokens=4, **GREEDY)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"


def test_store_false_and_delete(client):
    r = client.responses.create(model=MODEL, input="forget me", max_output_tokens=2, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", previous_response_id=r.id, max_output_tokens=2)
    kept = client.responses.create(model=MODEL, input="keep me", max_output_tokens=2, **GREEDY)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_async_client_stream_and_not(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        whole, stream = await asyncio.gather(
            client.responses.create(model=MODEL, input="async", max_output_tokens=6, **GREEDY),
            client.responses.create(model=MODEL, input="async", max_output_tokens=6, stream=True, **GREEDY))
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        return whole, "".join(deltas)

    whole, streamed = asyncio.run(main())
    assert whole.output_text == streamed


def test_logprobs_equal_chat_logprobs(client):
    r = client.responses.create(model=MODEL, input="logprobs", max_output_tokens=4, top_logprobs=2,
                                include=["message.output_text.logprobs"], **GREEDY)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "logprobs"}],
                                          max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY)
    ours = r.output[0].content[0].logprobs
    theirs = chat.choices[0].logprobs.content
    assert len(ours) == len(theirs) == 4
    for a, b in zip(ours, theirs, strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]


def test_named_function_and_its_output_round_trip(client):
    r = client.responses.create(model=MODEL, input="Turn the flag on.", tools=[FLAG_TOOL],
                                tool_choice={"type": "function", "name": "set_flag"}, max_output_tokens=30, **GREEDY)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "set_flag" and call.status == "completed"
    assert isinstance(json.loads(call.arguments)["on"], bool)  # structured output enforced the schema
    follow = [{"type": "function_call_output", "call_id": call.call_id, "output": "flag is on"}]
    r2 = client.responses.create(model=MODEL, input=follow, previous_response_id=r.id, tools=[FLAG_TOOL],
                                 tool_choice="none", max_output_tokens=5, **GREEDY)
    # The same exchange as chat messages: assistant tool_calls, then the tool result.
    chat = client.chat.completions.create(model=MODEL, max_tokens=5, tool_choice="none", **GREEDY, messages=[
        {"role": "user", "content": "Turn the flag on."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "set_flag", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "flag is on"}],
        tools=[{"type": "function", "function": {k: FLAG_TOOL[k] for k in ("name", "description", "parameters")}}])
    assert r2.output_text == chat.choices[0].message.content


def test_streamed_function_call_events(client):
    kw = dict(model=MODEL, input="Turn the flag on.", tools=[FLAG_TOOL], max_output_tokens=30, **GREEDY,
              tool_choice={"type": "function", "name": "set_flag"})
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    assert events[3].delta == events[4].arguments == whole.output[0].arguments
    assert events[5].item.name == "set_flag" and events[-1].response.output[0].arguments == whole.output[0].arguments


def test_required_tool_choice_gives_calls(client):
    r = client.responses.create(model=MODEL, input="Do something.", tools=[FLAG_TOOL], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=40, **GREEDY)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "set_flag"
    assert isinstance(json.loads(calls[0].arguments)["on"], bool)


def test_text_format_json_schema_is_enforced(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Is it?", max_output_tokens=30, **GREEDY,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert r.status == "completed" and set(json.loads(r.output_text)) == {"ok"}
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("extra, param", [
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"tools": [FLAG_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [FLAG_TOOL]}, "tool_choice"),  # "auto" needs --enable-auto-tool-choice, as in vLLM
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "image", "url": "x"}]}, "input"),
    ({"conversation": "conv_1"}, "conversation"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(client, extra, param):
    body = {"input": "x", "max_output_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, **body)
    assert e.value.body["param"] == param, e.value.body


def test_unknown_model_and_response_are_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")


def test_an_invalid_text_format_schema_names_text(server):
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": MODEL, "input": "x", "max_output_tokens": 4,
        "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nonsense"}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text", r.text
    assert r.json()["error"]["message"].startswith("text.format.schema: ")


@pytest.mark.parametrize("item, words", [
    ({"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}, "'input_text'"),
    ({"type": "message", "role": "robot", "content": "hi"}, "role"),
    ({"type": "reasoning", "summary": []}, "type"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[0].call_id is required"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"},
     "input: a function_call item's arguments must be a JSON object"),  # named the chat field before
])
def test_an_input_item_error_says_what_in_the_item_is_wrong(server, item, words):
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={"model": MODEL, "input": [item]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "input" and words in err["message"], r.text
    assert "valid string" not in err["message"] and "Item" not in err["message"]  # no model class names
