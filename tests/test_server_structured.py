"""Structured output through the server, driven by the official openai client (sync, async, streaming)
and LangChain: response_format, vLLM's guided_* and structured_outputs, n > 1, beam search, and 400s that
name the field. One module-scoped server on a tiny random Llama with SmolLM2's tokenizer.
"""

import asyncio
import json
import re

import openai
import pytest
from pydantic import BaseModel, Field
from structured_schemas import SCHEMAS, validate
from test_server import Server

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def server(tiny_hf_model, smollm_gguf_path, tmp_path_factory):
    tiny = tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024)
    with Server.running(["--model", tiny, "--tokenizer", smollm_gguf_path, "--served-model-name", MODEL,
                         "--kv-cache-memory", "32MiB"], tmp_path_factory.mktemp("srv-structured") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Who?"}],
                                          max_tokens=60, **kw)


def test_chat_response_format_json_schema_with_n(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = _chat(client, response_format=rf, n=3, temperature=1.0, seed=3)
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "stop"
        validate(json.loads(c.message.content), PERSON)


def test_chat_json_object_streaming(client):
    stream = _chat(client, response_format={"type": "json_object"}, stream=True, temperature=0.0)
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text.startswith("{")
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == "length"


def test_openai_parse_helper_returns_the_pydantic_object(client):
    class Reading(BaseModel):
        sensor: str = Field(max_length=6)
        ok: bool
        level: int = Field(ge=0, le=9)

    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Read."}],
                                      response_format=Reading, max_tokens=60, temperature=0.0)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Reading) and 0 <= parsed.level <= 9


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": r"\d{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"\d{3}-[a-z]{2}", t)),
    ({"guided_choice": ["red", "green", "light blue"]}, lambda t: t in ("red", "green", "light blue")),
    # bounded, so every sample stops: `[a-c]+` at temperature 1 ran to max_tokens in ~1 of 10 samples
    ({"guided_grammar": 'root ::= "<" [a-c] [a-c]? [a-c]? ">"'}, lambda t: re.fullmatch(r"<[a-c]{1,3}>", t)),
    ({"guided_json": PERSON, "guided_decoding_backend": "xgrammar"}, lambda t: validate(json.loads(t), PERSON) or 1),
    ({"guided_json": json.dumps(PERSON), "guided_whitespace_pattern": ""},
     lambda t: " " not in re.sub(r'"[^"]*"', "", t) and (validate(json.loads(t), PERSON) or 1)),
    ({"structured_outputs": {"regex": "(yes|no)!"}}, lambda t: t in ("yes!", "no!")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"structured_outputs": {"grammar": 'start: "x" DIGIT+\nDIGIT: /[0-9]/'}}, lambda t: re.fullmatch(r"x\d+", t)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
     lambda t: validate(json.loads(t), PERSON) or 1),
])
def test_completions_every_form_sync_and_streaming(client, extra, check):
    r = client.completions.create(model=MODEL, prompt=["Answer:", "Now:"], n=2, max_tokens=60, temperature=1.0,
                                  seed=1, extra_body=extra)
    assert len(r.choices) == 4
    for c in r.choices:
        assert c.finish_reason == "stop", c
        assert check(c.text), c.text
    texts: dict[int, str] = {}
    finish = {}
    for chunk in client.completions.create(model=MODEL, prompt="Go:", n=2, max_tokens=60, temperature=1.0, seed=2,
                                           stream=True, extra_body=extra):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert set(texts) == {0, 1} and set(finish.values()) == {"stop"}
    assert all(check(t) for t in texts.values()), texts


def test_any_whitespace_allows_newlines_and_may_ramble(client):
    """disable_any_whitespace=false: whitespace between tokens is free, so a random model may spend its
    tokens on it: "stop" outputs validate, "length" ones are a valid prefix."""
    r = client.completions.create(model=MODEL, prompt="x", n=4, max_tokens=60, temperature=1.0, seed=5,
                                  extra_body={"structured_outputs": {"json": PERSON, "disable_any_whitespace": False}})
    for c in r.choices:
        assert c.text.lstrip(" \n\r").startswith("{") and "\t" not in c.text
        if c.finish_reason == "stop":
            validate(json.loads(c.text), PERSON)
    assert any(ch in c.text for c in r.choices for ch in "\n\r")


def test_beam_search_with_a_choice(client):
    choices = ["north", "south", "east by east", "west"]
    r = client.completions.create(model=MODEL, prompt="Direction:", n=2, max_tokens=20, temperature=0.0,
                                  extra_body={"use_beam_search": True, "best_of": 3, "guided_choice": choices})
    assert len(r.choices) == 2 and all(c.text in choices and c.finish_reason == "stop" for c in r.choices)


def test_async_client_schema_validity_over_the_schema_set(server):
    """Every schema of the set, concurrently (so in shared batches), through the async client."""
    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        calls = [aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "JSON!"}], n=2, temperature=1.0, seed=i,
            max_tokens=120, response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s}})
            for i, s in enumerate(SCHEMAS)]
        try:
            return await asyncio.gather(*calls)
        finally:
            await aclient.close()

    results = asyncio.run(run())
    reasons = {"stop": 0, "length": 0}
    for schema, r in zip(SCHEMAS, results, strict=True):
        for c in r.choices:
            reasons[c.finish_reason] += 1
            if c.finish_reason == "stop":
                validate(json.loads(c.message.content), schema)
    assert len(SCHEMAS) >= 30 and reasons["stop"] >= 0.9 * 2 * len(SCHEMAS), reasons


def test_langchain_with_structured_output_returns_the_parsed_object(server):
    from langchain_openai import ChatOpenAI

    class Pet(BaseModel):
        """A pet."""

        kind: str = Field(description="cat or dog", max_length=5)
        legs: int = Field(ge=0, le=4)

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=60,
                     max_retries=0)
    pet = llm.with_structured_output(Pet).invoke("Describe a pet.")
    assert isinstance(pet, Pet) and 0 <= pet.legs <= 4


@pytest.mark.parametrize("extra, param, message", [
    ({"guided_regex": "[a-"}, "guided_regex", r"^guided_regex: invalid regex"),
    ({"guided_json": {"type": "object", "properties": {"a": {"if": {}}}}}, "guided_json",
     r"if/then/else.* at /properties/a is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", r"^response_format\.json_schema\.schema: invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     r"requires json_schema\.schema"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", r"^guided_grammar: invalid grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", r"must not be combined with guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": PERSON}, "response_format", r"combined"),
    ({"guided_choice": []}, "guided_choice", r"non-empty"),
    ({"guided_choice": ["a"], "guided_decoding_backend": "outlines"}, "guided_decoding_backend", r"xgrammar"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", r"requires guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", r"exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", r"structural_tag"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", r"^structured_outputs\.regex: invalid"),
    ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos", r"ignore_eos must be false"),
    ({"response_format": {"type": "yaml"}}, "response_format", r"response_format"),
    ({"guided_regex": ""}, "guided_regex", r"^guided_regex must be a non-empty string"),  # named "none" before
    ({"structured_outputs": {"regex": ""}}, "structured_outputs", r"^structured_outputs\.regex must be a non-empty"),
    # past MAX_SPEC_CHARS: 20,000 choices compiled for 10-16 s, unstoppable, before the cap
    ({"guided_choice": [f"option {i}" for i in range(20_000)]}, "guided_choice",
     r"^guided_choice: the spec is \d+ characters long, more than the 131072"),
])
def test_bad_specs_are_400s_naming_the_field(client, server, extra, param, message):
    for call in (lambda: _chat(client, extra_body=extra),
                 lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body=extra)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        err = e.value.body
        assert err["param"] == param, err
        assert re.search(message, err["message"]), err
    assert "Traceback" not in server.output()


def test_masks_that_leave_no_token_are_400s(client, server):
    """allowed_token_ids that the grammar (or bad_words) exclude entirely: a 400 naming the field at admission;
    a grammar whose every digit bad_words bans: a 400 saying where no token was left (it had sampled token 0 and
    failed as a 500 server_error)."""
    comma = 28  # "," in SmolLM2's vocabulary
    for extra in ({"allowed_token_ids": [comma], "guided_choice": ["Paris", "Lyon"]},
                  {"allowed_token_ids": [comma], "bad_words": [","]}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body=extra)
        assert e.value.body["param"] == "allowed_token_ids", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=3,
                                  extra_body={"guided_regex": "[0-9]+", "bad_words": list("0123456789")})
    assert e.value.body["message"].startswith("no token is allowed at output position 0"), e.value.body
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=3).choices[0].finish_reason == "length"
    assert "Traceback" not in server.output()
