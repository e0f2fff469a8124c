"""vLLM's service endpoints and HTTP options on a real server: /version, /ping, /invocations, /tokenizer_info,
/openapi.json and /docs, X-Request-Id (--enable-request-id-headers) and --root-path.

Two tiny servers: one with every option on (and an API key), one with the defaults, to see the options off.
"""

import json

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_server import MODEL, Server

from pagellm.server.common import sse

pytestmark = pytest.mark.timeout(240)

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = dict(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def tiny_args(tiny_hf_model, smollm_gguf_path):
    path = tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024)
    return ["--model", path, "--tokenizer", smollm_gguf_path, "--served-model-name", MODEL,
            "--kv-cache-memory", "16MiB"]


@pytest.fixture(scope="module")
def full(tiny_args, tmp_path_factory):
    with Server.running([*tiny_args, "--api-key", KEY, "--enable-request-id-headers", "--root-path", "/api",
                         "--enable-tokenizer-info-endpoint"], tmp_path_factory.mktemp("full") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def plain(tiny_args, tmp_path_factory):
    with Server.running(tiny_args, tmp_path_factory.mktemp("plain") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(full):
    return openai.OpenAI(base_url=full.url + "/v1", api_key=KEY, max_retries=0)


def test_version_and_ping(full):
    import pagellm

    assert httpx.get(full.url + "/version").json() == {"version": pagellm.__version__}
    for method in ("GET", "POST"):  # SageMaker's health check; open like /health
        assert httpx.request(method, full.url + "/ping").status_code == 200


def test_invocations_routes_by_body_shape(full, client):
    chat_body = {"messages": [{"role": "user", "content": "hi"}], **GREEDY}
    expected_chat = client.chat.completions.create(model=MODEL, **chat_body).choices[0].message.content
    r = httpx.post(full.url + "/invocations", json=chat_body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    assert r.json()["choices"][0]["message"]["content"] == expected_chat
    expected = client.completions.create(model=MODEL, prompt="hi", **GREEDY).choices[0].text
    r = httpx.post(full.url + "/invocations", json={"prompt": "hi", **GREEDY}, headers=AUTH, timeout=60)
    assert r.json()["object"] == "text_completion" and r.json()["choices"][0]["text"] == expected
    emb = client.embeddings.create(model=MODEL, input="hi").data[0].embedding
    r = httpx.post(full.url + "/invocations", json={"input": "hi"}, headers=AUTH, timeout=60)
    assert r.json()["data"][0]["embedding"] == pytest.approx(emb)
    bad = [({"text": "no route"}, "messages"), ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
           ({"messages": []}, "messages")]
    for body, param in bad:
        r = httpx.post(full.url + "/invocations", json=body, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    for raw in (b"{not json", b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}"):  # past int()'s 4,300 digits
        r = httpx.post(full.url + "/invocations", content=raw, headers=AUTH)
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text
    # It generates like /v1 does, so it is behind the same key.
    assert httpx.post(full.url + "/invocations", json={"prompt": "x"}).status_code == 401


def test_tokenizer_info_only_when_enabled(full, plain):
    info = httpx.get(full.url + "/tokenizer_info").json()
    assert info["tokenizer_class"] and info["vocab_size"] == 49152 and info["model_max_length"] == 1024
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    assert httpx.get(plain.url + "/tokenizer_info").status_code == 404


def test_openapi_describes_every_route_and_body_without_the_key(full):
    r = httpx.get(full.url + "/openapi.json")  # no API key: vLLM serves the schema openly
    assert r.status_code == 200
    spec = r.json()
    paths = spec["paths"]
    for route in ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses",
                  "/v1/responses/{response_id}", "/health", "/ping", "/metrics", "/tokenize", "/detokenize",
                  "/version", "/invocations", "/tokenizer_info"):
        assert route in paths, route
    schemas = spec["components"]["schemas"]
    for route, ops in paths.items():
        for method, op in ops.items():
            if method != "post" or route == "/ping":
                continue
            schema = op["requestBody"]["content"]["application/json"]["schema"]
            refs = [s["$ref"] for s in schema.get("oneOf", [schema])]
            for ref in refs:  # a pydantic model, so clients and /docs see the fields
                assert ref.startswith("#/components/schemas/") and ref.split("/")[-1] in schemas, (route, ref)
    assert {"messages", "temperature", "max_tokens"} <= set(schemas["ChatCompletionRequest"]["properties"])
    assert {"input", "instructions", "previous_response_id"} <= set(schemas["ResponsesRequest"]["properties"])
    # The key is declared, so /docs offers it; and the proxy prefix shows as the server URL.
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert paths["/v1/completions"]["post"]["security"] == [{"HTTPBearer": []}]
    assert spec["servers"] == [{"url": "/api"}]


def test_docs_page_loads_the_schema(full):
    html = httpx.get(full.url + "/docs").text
    # Swagger UI itself comes from a CDN at view time; the page must point it at our schema.
    assert "swagger-ui" in html and "'/api/openapi.json'" in html
    assert httpx.get(full.url + "/redoc").status_code == 200


def test_root_path_serves_with_and_without_the_prefix(full):
    for prefix in ("", "/api"):  # behind a proxy that strips the prefix, or one that passes it on
        r = httpx.get(full.url + prefix + "/v1/models", headers=AUTH)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
        assert httpx.get(full.url + prefix + "/health").status_code == 200


def test_request_id_header_echoed_or_generated(full, client):
    r = httpx.post(full.url + "/v1/completions", headers={**AUTH, "X-Request-Id": "trace-42"}, timeout=60,
                   json={"model": MODEL, "prompt": "hi", **GREEDY})
    # The client's id is the header and the engine request's id, as in vLLM.
    assert r.headers["x-request-id"] == "trace-42" and r.json()["id"] == "cmpl-trace-42"
    r = httpx.post(full.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **GREEDY})
    generated = r.headers["x-request-id"]
    assert len(generated) == 32 and r.json()["id"] == f"chatcmpl-{generated}"  # one id for header and body
    with httpx.stream("POST", full.url + "/v1/chat/completions", headers={**AUTH, "X-Request-Id": "s-1"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                            **GREEDY}, timeout=60) as s:
        assert s.headers["x-request-id"] == "s-1"
        assert '"id":"chatcmpl-s-1"' in s.read().decode()
    # Every response carries it, errors and non-API routes included.
    assert "x-request-id" in httpx.get(full.url + "/v1/models").headers  # a 401
    assert httpx.get(full.url + "/health", headers={"X-Request-Id": "h"}).headers["x-request-id"] == "h"
    # A response's id is always fresh: it is stored and read back under it, so a reused (or guessed) header must
    # neither replace another response nor reveal it.
    made = []
    for text in ("hi", "Name a colour."):
        raw = client.with_raw_response.responses.create(model=MODEL, input=text, max_output_tokens=4,
                                                        extra_headers={"X-Request-Id": "r-9"})
        assert raw.headers["x-request-id"] == "r-9"
        made.append(raw.parse())
    assert made[0].id != made[1].id and all(r.id.startswith("resp_") and len(r.id) == 37 for r in made)
    for r in made:
        assert client.responses.retrieve(r.id).output_text == r.output_text


def test_a_request_id_in_use_does_not_fail_a_second_request(full):
    """Two requests under one X-Request-Id at once (a tracing header reused): both run, each with its own output,
    and both answer with the client's id (the second had been a 400 "request id ... is already in use"; vLLM
    since its PR 27987 suffixes engine ids to keep them unique)."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    short = {"model": MODEL, "prompt": "y", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(full.url + "/v1/completions", headers=AUTH, json=short, timeout=60).json()
    with httpx.stream("POST", full.url + "/v1/completions", headers={**AUTH, "X-Request-Id": "dup"}, json=body,
                      timeout=60) as first:
        lines = first.iter_lines()  # kept: a dropped iterator closes the response, aborting the request
        assert next(line for line in lines if line.startswith("data:"))  # the first is running
        second = httpx.post(full.url + "/v1/completions", headers={**AUTH, "X-Request-Id": "dup"}, timeout=60,
                            json=short)
        rest = "\n".join(lines)
    assert second.status_code == 200 and second.json()["id"] == "cmpl-dup", second.text
    assert second.json()["choices"][0]["text"] == alone["choices"][0]["text"]
    assert '"id":"cmpl-dup"' in rest and "[DONE]" in rest and "error" not in rest


def test_without_the_flag_no_header_but_the_client_id_still_names_the_request(plain):
    r = httpx.post(plain.url + "/v1/completions", headers={"X-Request-Id": "mine"}, timeout=60,
                   json={"model": MODEL, "prompt": "hi", **GREEDY})
    assert "x-request-id" not in r.headers and r.json()["id"] == "cmpl-mine"
    assert "servers" not in httpx.get(plain.url + "/openapi.json").json()


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/responses"])
def test_streamed_line_separators_stay_inside_their_chunk_for_a_splitlines_reader(plain, route):
    # U+0085, U+2028 and U+2029 are line ends to str.splitlines (httpx's iter_lines) but not to SSE, and
    # json.dumps writes them raw: a sampled token decoding to one cut its chunk in two in a serving benchmark.
    text = "a\u2028b\x85c\u2029d"
    body = ({"prompt": text, "echo": True} if route == "/v1/completions" else {"input": "hi", "instructions": text}) | {
        "model": MODEL, "max_tokens" if route == "/v1/completions" else "max_output_tokens": 3, "stream": True,
        "temperature": 0}
    with httpx.stream("POST", plain.url + route, json=body, timeout=60) as r:
        assert r.status_code == 200
        data = [ln[5:].strip() for ln in r.iter_lines() if ln.startswith("data:")]
    chunks = [json.loads(d) for d in data if d != "[DONE]"]  # a cut chunk fails here
    if route == "/v1/completions":
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).startswith(text)
    else:  # every event that carries the response carries its instructions
        assert chunks[0]["response"]["instructions"] == text


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_an_sse_chunk_is_one_line_to_every_splitter_and_round_trips(text):
    event = sse({"text": text, "n": [text]})
    lines = event.splitlines()  # the widest splitter: every SSE line end and U+0085, U+2028, U+2029, \x1c-\x1e
    assert len(lines) == 2 and lines[1] == "" and event.endswith("\n\n")
    assert json.loads(lines[0][len("data: "):]) == {"text": text, "n": [text]}
