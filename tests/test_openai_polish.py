"""Interactions of the OpenAI surface found by trying it as a client would: echo + logprobs with
return_tokens_as_token_ids, add_special_tokens on chat, /tokenize with the chat request's templating
fields (tools, continue_final_message, chat_template_kwargs, chat_template), a request's own chat_template
(refused unless trusted, and sandboxed when trusted), a Responses conversation continued after a call cut
by max_output_tokens, and a draft-model proposer failing on one request's parameters."""

import asyncio
import json
from types import SimpleNamespace

import httpx
import openai
import pytest
from test_server import MODEL, Server, tiny_path  # noqa: F401
from tokenizers import processors

from pagellm import LLM, SamplingParams
from pagellm.server.errors import APIError
from pagellm.server.protocol import ChatMessage
from pagellm.server.serving_chat import render_chat
from pagellm.server.serving_chat_tools import ChatSettings
from pagellm.tokenizer import Tokenizer

# tiny random model: seconds per test; minutes mean something hangs
pytestmark = pytest.mark.timeout(180)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
HI = [{"role": "user", "content": "hi"}]
PLAIN_TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                  "{% if add_generation_prompt %}[assistant]{% endif %}{{ suffix }}")


@pytest.fixture(scope="module")
def server(tiny_path, smollm_gguf_path, tmp_path_factory):  # noqa: F811
    s = Server(["--model", tiny_path, "--tokenizer", smollm_gguf_path, "--served-model-name", MODEL,
                "--kv-cache-memory", "16MiB", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                "--trust-request-chat-template"], tmp_path_factory.mktemp("polish") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def tokenize(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/tokenize", json={"model": MODEL, **body}, timeout=60)


def test_echo_logprobs_spell_prompt_tokens_as_ids_too(server, client):
    prompt = "Hello there, general"
    ids = tokenize(server, prompt=prompt).json()["tokens"]
    kw = dict(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=3, temperature=0.0)
    plain = client.completions.create(**kw).choices[0].logprobs
    as_ids = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    # every token, the echoed prompt's included, is "token_id:N"; the prompt's ids are the tokenizer's
    assert all(t.startswith("token_id:") for t in as_ids.tokens)
    assert [int(t.split(":")[1]) for t in as_ids.tokens[:len(ids)]] == ids
    assert as_ids.top_logprobs[0] is None
    assert all(all(k.startswith("token_id:") for k in top) for top in as_ids.top_logprobs[1:])
    # offsets still count the text, and the logprobs are the same numbers
    assert as_ids.text_offset == plain.text_offset
    assert as_ids.token_logprobs == plain.token_logprobs

    async def streamed():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        stream = await ac.completions.create(**kw, stream=True, extra_body={"return_tokens_as_token_ids": True})
        return [t async for chunk in stream for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]

    assert asyncio.run(streamed()) == as_ids.tokens


def _bos_tokenizer(path: str) -> Tokenizer:
    """SmolLM2's tokenizer adds no BOS; this copy adds <|im_start|> (id 1), as a Llama tokenizer adds <s>."""
    tok = Tokenizer.from_path(path)
    tok.backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A $B", special_tokens=[("<|im_start|>", 1)])
    return tok


def test_chat_add_special_tokens_adds_the_tokenizers_bos(smollm_gguf_path):
    ctx = SimpleNamespace(engine=SimpleNamespace(tokenizer=_bos_tokenizer(smollm_gguf_path)), chat=ChatSettings())
    messages = [ChatMessage(role="user", content="hi")]
    without = render_chat(ctx, messages, True, False)
    with_bos = render_chat(ctx, messages, True, True)
    assert with_bos == [1, *without]  # the template's own <|im_start|> stays; the tokenizer adds one more


def test_chat_add_special_tokens_is_a_field_of_the_request(server, client):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, extra_body={"add_special_tokens": True})
    counted = tokenize(server, messages=HI, add_special_tokens=True).json()["count"]
    assert r.usage.prompt_tokens == counted
    assert "request fields ignored" not in server.output()  # not an unknown (ignored) field


def test_tokenize_counts_what_the_chat_request_would_send(server, client):
    r = client.chat.completions.create(model=MODEL, messages=HI, tools=TOOLS, tool_choice="auto", max_tokens=1)
    with_tools = tokenize(server, messages=HI, tools=TOOLS).json()["count"]
    assert with_tools == r.usage.prompt_tokens > tokenize(server, messages=HI).json()["count"]

    convo = [*HI, {"role": "assistant", "content": "Sure, the answer"}]
    strs = tokenize(server, messages=convo, continue_final_message=True, add_generation_prompt=False,
                    return_token_strs=True).json()["token_strs"]
    assert "".join(strs).replace("Ġ", " ").endswith("the answer")  # left open, no end-of-turn token
    r = client.chat.completions.create(model=MODEL, messages=convo, max_tokens=1,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.usage.prompt_tokens == len(strs)

    body = dict(messages=HI, chat_template=PLAIN_TEMPLATE, chat_template_kwargs={"suffix": " OK"})
    t = tokenize(server, **body, return_token_strs=True).json()
    assert "".join(t["token_strs"]).replace("Ġ", " ").replace("Ċ", "\n") == "[user] hi\n[assistant] OK"
    r = client.chat.completions.create(model=MODEL, max_tokens=1, messages=HI,
                                       extra_body={k: v for k, v in body.items() if k != "messages"})
    assert r.usage.prompt_tokens == t["count"]


@pytest.mark.parametrize("field,value", [("tools", TOOLS), ("continue_final_message", True),
                                         ("chat_template", PLAIN_TEMPLATE)])
def test_tokenize_refuses_chat_fields_with_a_prompt(server, field, value):
    r = tokenize(server, prompt="hi", **{field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_a_request_chat_template_is_refused_unless_the_server_trusts_them(smollm_gguf_path):
    ctx = SimpleNamespace(engine=SimpleNamespace(tokenizer=Tokenizer.from_path(smollm_gguf_path)),
                          chat=ChatSettings())
    body = SimpleNamespace(documents=None, chat_template_kwargs=None, continue_final_message=False,
                           chat_template=PLAIN_TEMPLATE)
    with pytest.raises(APIError) as e:
        render_chat(ctx, [ChatMessage(role="user", content="hi")], body=body)
    assert e.value.status == 400 and e.value.param == "chat_template"
    assert "--trust-request-chat-template" in str(e.value)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('cat /etc/passwd').read() }}",
    "{% include '/etc/passwd' %}",
    "{% import 'os' as os %}{{ os.environ }}",
    "{{ messages.append(1) }}",
    "{{ 1 / 0 }}",
])
def test_a_trusted_request_template_still_runs_in_the_sandbox(server, template):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": HI, "max_tokens": 1, "chat_template": template})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "chat_template"
    assert "root:" not in err["message"]


@pytest.mark.parametrize("template", ["{{ lipsum.__globals__ }}x", "{{ raise_exception.__globals__ }}x",
                                      "{{ self._TemplateReference__context }}x"])
def test_unsafe_attributes_render_as_nothing(server, template):
    r = tokenize(server, messages=HI, chat_template=template, return_token_strs=True)
    assert r.status_code == 200 and r.json()["token_strs"] == ["x"]


def test_a_responses_conversation_goes_on_after_a_call_cut_by_max_output_tokens(client):
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    first = client.responses.create(model=MODEL, input="weather in Paris?", tools=tools, tool_choice="required",
                                    max_output_tokens=24, temperature=0.0)
    # the random model writes a city name longer than that: the call's arguments are not JSON yet
    call = next(o for o in first.output if o.type == "function_call")
    assert first.status == "incomplete" and call.arguments.startswith('{"city')
    with pytest.raises(ValueError):
        json.loads(call.arguments)
    nxt = client.responses.create(model=MODEL, previous_response_id=first.id, tools=tools, max_output_tokens=3,
                                  input=[{"type": "function_call_output", "call_id": call.call_id,
                                          "output": "sunny"}])
    assert nxt.status in ("completed", "incomplete") and nxt.previous_response_id == first.id
    assert nxt.usage.input_tokens > first.usage.input_tokens


def test_draft_proposer_failures_stay_with_their_request(tiny_path, smollm_gguf_path, poison_when_admitted):  # noqa: F811
    llm = LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory="8MiB", speculative_method="draft",
              draft_model=tiny_path, num_speculative_tokens=3, draft_kv_cache_memory="8MiB")
    prompts = [[5 + i, 6, 7, 8] * 3 for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    clean = llm.generate(prompts, greedy, use_tqdm=False)
    # the largest seed SamplingParams accepts: the draft's generator is seeded with seed + 1
    top_seed = SamplingParams(temperature=1.0, seed=2**64 - 1, max_tokens=10, ignore_eos=True)
    bad_bias = SamplingParams(temperature=1.0, seed=3, max_tokens=10)
    # past validation: fails the draft's and the target's sampling
    poison_when_admitted(llm.engine, bad_bias, logit_bias={5: "not a number"})
    outs = llm.generate([*prompts, [9, 10, 11], [12, 13, 14]], [greedy] * 4 + [top_seed, bad_bias], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:4]] == [o.outputs[0].token_ids for o in clean]
    assert outs[4].error is None and len(outs[4].outputs[0].token_ids) == 10
    assert outs[5].error is not None and outs[5].outputs[0].finish_reason == "error"
    kv = llm.engine.kv_cache
    assert kv.pool.num_free == kv.num_blocks
