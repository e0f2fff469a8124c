"""What a probe of the running server found (twenty-second session), each now a test: lone UTF-16 surrogates
in any string (a 500 from the tokenizer or from the JSON of the 404 naming a model), a 500 that cost the
client its next request on the same connection, a form-encoded body, models.retrieve(), a logit_bias key's
error naming the wrong field, and a multi-prompt request whose client left while it was being admitted."""

import asyncio
import json
import socket
import threading

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from polling import wait_until
from test_server import MODEL, Server

from pagellm.server.errors import install_error_handlers
from pagellm.server.middleware import lone_surrogate

# one tiny server and a few dozen small requests: well under a minute; longer means something hangs
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def server(tiny_hf_model, smollm_gguf_path, tmp_path_factory):
    path = tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024)
    with Server.running(["--model", path, "--tokenizer", smollm_gguf_path, "--served-model-name", MODEL,
                         "--kv-cache-memory", "16MiB"], tmp_path_factory.mktemp("srv") / "server.log") as s:
        yield s


def _post(http: httpx.Client, path: str, raw_json: str) -> httpx.Response:
    return http.post(path, content=raw_json.encode(), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", '{"model": "' + MODEL + '", "prompt": "abc\\ud800", "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\udc00y"}], "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}'),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}'),
    ("/tokenize", '{"prompt": "\\ud800 \\\\ud800"}'),
    ("/v1/embeddings", '{"input": "a\\ud83d b"}'),
])
def test_lone_surrogates_are_a_400_and_the_connection_stays_usable(server, path, body):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for _ in range(3):  # the same connection: a 500 used to be re-raised to uvicorn, which closed it
            r = _post(http, path, body)
            assert r.status_code == 400, r.text
            assert "surrogate" in r.json()["error"]["message"], r.text
            ok = _post(http, "/v1/completions", '{"prompt": "hi", "max_tokens": 1}')
            assert ok.status_code == 200, ok.text


def test_a_surrogate_pair_is_a_character(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = _post(http, "/tokenize", '{"prompt": "smile \\ud83d\\ude00, a backslash-u: \\\\ud800"}')
        assert r.status_code == 200, r.text
        direct = http.post("/tokenize", json={"prompt": "smile \U0001F600, a backslash-u: \\ud800"}).json()
        assert r.json()["tokens"] == direct["tokens"]


@pytest.mark.parametrize(("body", "found"), [
    (b'"\\ud800"', "U+D800"), (b'"\\\\\\udfff"', "U+DFFF"), (b'["\\ud83dx\\ude00"]', "U+D83D"),
    (b'{"a": "\\ud83d\\u0041"}', "U+D83D"), (b'{"\\ud800": 1}', "U+D800"), (b'"\\\\ud83d\\udc00"', "U+DC00"),
    (b'"\\ud83d\\ude00 \\n \\\\ud800"', None), (b'"plain"', None), (b'{"a": "\\ud800"', None),
])
def test_lone_surrogate_scan(body, found):
    """found: the code point named, None where the body has no lone half (or is no JSON: the route says so)."""
    message = lone_surrogate(body)
    assert (message is None) if found is None else (message is not None and found in message), message


def test_a_form_encoded_body_is_told_to_send_json(server):
    r = httpx.post(server.url + "/v1/completions", data={"prompt": "hi"}, timeout=60)
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"], r.text


def test_a_wrong_shape_names_what_the_field_takes_here(server):
    """/tokenize's prompt is a string: its 400 no longer lists the completions prompt's union of shapes."""
    r = httpx.post(server.url + "/tokenize", json={"prompt": ["a"]}, timeout=60)
    assert r.status_code == 400 and "token ids" not in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/completions", json={"prompt": 5, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and "list of token ids" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("field", ["max_tokens", "n", "logprobs", "seed"])
def test_a_boolean_is_no_integer(server, field):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert "boolean" in r.json()["error"]["message"], r.text


def test_models_retrieve(server):
    client = server.client()
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"
    listed = httpx.get(server.url + "/v1/models/", timeout=60).json()  # the trailing slash: still the list
    assert listed["object"] == "list" and listed["data"][0]["id"] == MODEL


def test_a_logit_bias_key_out_of_range_names_logit_bias(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=MODEL, prompt="hi", max_tokens=2, logit_bias={"999999": 5})
    assert e.value.body["param"] == "logit_bias", e.value.body


def test_a_multi_prompt_request_whose_client_left_leaves_nothing_running(server):
    before = server.metrics()
    body = {"model": MODEL, "prompt": [f"story {i}" for i in range(40)], "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)

    def idle():
        m = server.metrics()
        return m["pagellm:num_requests_running"] == 0 and m["pagellm:num_requests_waiting"] == 0 and \
            m["pagellm:kv_cache_usage_perc"] == 0

    wait_until(idle, timeout=60, what="the 40 prompts aborted")
    after = server.metrics()
    key = "pagellm:request_success_total{finished_reason=abort}"
    assert after.get(key, 0) - before.get(key, 0) == 40
    ok = server.client().completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_bug_is_a_500_that_keeps_the_connection():
    """InternalErrorMiddleware, in a real uvicorn: the route raises, the client gets the error object and its
    next request on the same connection is answered."""
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    @app.get("/ok")
    async def ok():
        return {"ok": True}

    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: srv.started, timeout=30, what="uvicorn started")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            for _ in range(10):
                r = http.get("/boom")
                assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
                assert http.get("/ok").json() == {"ok": True}
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


def test_concurrent_bad_and_good_requests(server):
    """Bad requests of every kind above, sent while good ones stream: the good ones all finish."""
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            good = {"model": MODEL, "prompt": "hi", "max_tokens": 16, "ignore_eos": True}
            bad = ['{"prompt": "\\ud800"}', '{"prompt": "hi", "logit_bias": {"999999": 1}}', '{"prompt": ',
                   '{"model": "\\udc00"}']
            tasks = [http.post("/v1/completions", json=good) for _ in range(3)]
            tasks += [http.post("/v1/completions", content=b.encode(), headers={"Content-Type": "application/json"})
                      for b in bad]
            return await asyncio.gather(*tasks)

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [200] * 3 + [400] * 4, [r.text for r in responses]
    assert all(json.loads(r.text)["usage"]["completion_tokens"] == 16 for r in responses[:3])


# The twenty-fifth session's probe: two requests that had taken the whole server down, and three gaps.
def test_a_client_id_shaped_like_a_sequence_id_runs_beside_its_namesake(server):
    """X-Request-Id 'zz#1' in flight while 'zz' asks for n = 2 (whose second sequence had been named 'cmpl-zz#1'):
    both finish, and the server goes on."""
    body = {"model": MODEL, "prompt": "Tell me", "max_tokens": 24, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60,
                      headers={"X-Request-Id": "zz#1"}) as first:
        lines = first.iter_lines()
        next(lines)  # in flight
        second = httpx.post(server.url + "/v1/completions", json={**body, "n": 2}, timeout=60,
                            headers={"X-Request-Id": "zz"})
        events = [ln for ln in lines if ln.startswith("data:")]
    assert second.status_code == 200 and [c["index"] for c in second.json()["choices"]] == [0, 1]
    assert events[-1] == "data: [DONE]" and '"error"' not in "".join(events)
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("value", ["1e308", "-1100", "-Infinity", "NaN"])
def test_an_extreme_length_penalty_is_a_400_not_a_dead_engine(server, value):
    raw = ('{"model": "' + MODEL + '", "prompt": "hi", "max_tokens": 3, "use_beam_search": true, "n": 2, '
           '"length_penalty": ' + value + '}')
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = _post(http, "/v1/completions", raw)
        assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty", r.text
        ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 2,
                                                "use_beam_search": True, "length_penalty": 2.0})
        assert ok.status_code == 200


def test_invocations_body_nested_too_deeply_is_a_400(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = _post(http, "/invocations", "[" * 100_000 + "]" * 100_000)
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]


def test_tokenize_caps_messages_as_chat_does(server):
    r = httpx.post(server.url + "/tokenize", timeout=60,
                   json={"messages": [{"role": "user", "content": "a"}] * 16385})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_responses_max_output_tokens_past_the_context_is_a_400(server):
    r = httpx.post(server.url + "/v1/responses", timeout=60,
                   json={"model": MODEL, "input": "Hi", "max_output_tokens": 10**9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
    assert "maximum context length is 1024 tokens" in r.json()["error"]["message"]


@pytest.mark.parametrize("part", [{"type": "text"}, {"type": "text", "text": 5}, {"type": "text", "text": None}])
def test_a_text_part_without_its_text_is_a_400(server, part):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": [part]}], "max_tokens": 2})
    assert r.status_code == 400 and "text content part" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("key", ["1_000", "--5", "+5", "5.0"])
def test_a_logit_bias_key_is_plain_digits(server, key):
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "logit_bias": {key: 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
