"""Security and memory caps, through the real server and the official openai client: the API key (file,
constant-time compare, /metrics and /health behind it with --protect-metrics), CORS only for listed
origins, the warning for a public bind without a key, prompts never in the log unless --log-requests, no
request field that reads a local path, and hostile sizes refused fast (413 for the body, 400 naming the
field for n, logprobs, logit_bias, stop lists, messages, prompt lists, prompt tokens)."""

import asyncio
import json
import os
import re
import time

import httpx
import openai
import pytest
from test_server import MODEL, Server

from pagellm.server.middleware import key_matches

# two tiny servers (~5 s each) and ~40 requests, the largest a 29 MiB body of 10**6 messages
pytestmark = pytest.mark.timeout(240)

KEY = "s3cret-key-from-a-file"
ORIGIN = "http://ok.example"
MARKER = "zebra-marker-8812"


@pytest.fixture(scope="module")
def tiny_path(tiny_hf_model):
    return tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024)


class KeyedServer(Server):
    """Server whose readiness probe sends the key (with --protect-metrics /health needs it)."""

    def _wait_ready(self, timeout: float = 180.0) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = re.search(r"ready: serving \S+ at (http://\S+)/v1", self.output())
            if m:
                assert httpx.get(m.group(1) + "/health", headers=auth()).status_code == 200
                return m.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server did not start:\n{self.output()[-3000:]}")


@pytest.fixture(scope="module")
def locked(tiny_path, smollm_gguf_path, tmp_path_factory):
    """Key from a file, /metrics and /health behind it, CORS for ORIGIN, a 64 KiB body cap, --log-requests."""
    d = tmp_path_factory.mktemp("locked")
    (d / "key").write_text(f"{KEY}\nthis second line is not part of the key\n")
    s = KeyedServer(["--model", tiny_path, "--tokenizer", smollm_gguf_path, "--served-model-name", MODEL,
                     "--kv-cache-memory", "16MiB", "--api-key-file", str(d / "key"), "--protect-metrics",
                     "--allowed-origins", ORIGIN, "--max-request-body-bytes", "64KiB", "--log-requests"],
                    d / "server.log")
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.output()[-3000:]


@pytest.fixture(scope="module")
def public(tiny_path, smollm_gguf_path, tmp_path_factory):
    """Defaults, bound to 0.0.0.0, no key."""
    with Server.running(["--model", tiny_path, "--tokenizer", smollm_gguf_path, "--served-model-name", MODEL,
                         "--kv-cache-memory", "16MiB", "--host", "0.0.0.0"],
                        tmp_path_factory.mktemp("public") / "server.log") as s:
        yield s


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


# ---- the API key ---------------------------------------------------------------------------------

def test_key_matches_only_the_bearer_key():
    assert key_matches(f"Bearer {KEY}", KEY) and key_matches(f"bearer  {KEY} ", KEY)
    for header in (None, "", KEY, f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer "):
        assert not key_matches(header, KEY), header


def test_api_key_sources_and_loopback_hosts(tmp_path, monkeypatch):
    from argparse import Namespace

    from pagellm.server.launch import is_loopback, resolve_api_key

    (tmp_path / "key").write_text(" k-file \nnot this\n")
    (tmp_path / "empty").write_text("\n")
    monkeypatch.delenv("PAGELLM_API_KEY", raising=False)
    assert resolve_api_key(Namespace(api_key=None, api_key_file=str(tmp_path / "key"))) == "k-file"
    assert resolve_api_key(Namespace(api_key="k-flag", api_key_file=None)) == "k-flag"
    assert resolve_api_key(Namespace(api_key="", api_key_file=None)) is None
    with pytest.raises(ValueError, match="not both"):
        resolve_api_key(Namespace(api_key="k-flag", api_key_file=str(tmp_path / "key")))
    with pytest.raises(ValueError, match="first line is empty"):
        resolve_api_key(Namespace(api_key=None, api_key_file=str(tmp_path / "empty")))
    with pytest.raises(FileNotFoundError):
        resolve_api_key(Namespace(api_key=None, api_key_file=str(tmp_path / "missing")))
    monkeypatch.setenv("PAGELLM_API_KEY", "k-env")  # the env is --api-key's default: the file replaces it
    assert resolve_api_key(Namespace(api_key="k-env", api_key_file=str(tmp_path / "key"))) == "k-file"
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "example.com"]))


def test_the_key_from_the_file_guards_v1_sync_async_and_streaming(locked):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=locked.url + "/v1", api_key="wrong", max_retries=0).models.list()
    for headers in ({}, {"Authorization": f"Basic {KEY}"}, auth(KEY + "\nthis second line")):
        r = httpx.get(locked.url + "/v1/models", headers={k: v.replace("\n", " ") for k, v in headers.items()})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    client = openai.OpenAI(base_url=locked.url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens == 3
    chunks = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=3, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"

    async def main():
        async with openai.AsyncOpenAI(base_url=locked.url + "/v1", api_key=KEY, max_retries=0) as c:
            r = await c.chat.completions.create(model=MODEL, max_tokens=3,
                                                messages=[{"role": "user", "content": "hi"}])
            return r.choices[0].finish_reason

    assert asyncio.run(main()) == "length"
    # refused before the body is read: a big body without the key is a 401, not a 413
    r = httpx.post(locked.url + "/v1/completions", content=b"x" * 200_000)
    assert r.status_code == 401


def test_protect_metrics_closes_metrics_and_health(locked, public):
    for path in ("/metrics", "/health", "/ping"):
        r = httpx.get(locked.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        assert httpx.get(locked.url + path, headers=auth()).status_code == 200, path
        assert httpx.get(public.url + path).status_code == 200, path  # open by default
    assert httpx.get(locked.url + "/version").status_code == 200  # vLLM's rule: only /v1 needs the key


# ---- CORS ----------------------------------------------------------------------------------------

def _preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(url + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_only_for_listed_origins(locked, public):
    ok = _preflight(locked.url, ORIGIN)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-origin" not in _preflight(locked.url, "http://evil.example").headers
    r = httpx.get(locked.url + "/v1/models", headers={"Origin": ORIGIN, **auth()})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    # a 401 still carries the header, so a page can read why it failed
    assert httpx.get(locked.url + "/v1/models", headers={"Origin": ORIGIN}).headers[
        "access-control-allow-origin"] == ORIGIN
    # no --allowed-origins: CORS off, no header for anyone
    assert "access-control-allow-origin" not in _preflight(public.url, ORIGIN).headers
    r = httpx.get(public.url + "/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


# ---- binding and logging -------------------------------------------------------------------------

def test_public_bind_without_a_key_warns(locked, public):
    warning = "without an API key: anyone who can reach this address can use the model"
    assert warning in public.output() and "0.0.0.0" in public.output()
    assert warning not in locked.output()


def test_prompts_and_outputs_are_logged_only_with_log_requests(locked, public):
    for server, headers in ((locked, auth()), (public, {})):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        client.completions.create(model=MODEL, prompt=f"completion {MARKER}", max_tokens=3)
        list(client.chat.completions.create(model=MODEL, max_tokens=3, stream=True,
                                            messages=[{"role": "user", "content": f"chat {MARKER}"}]))
        with pytest.raises(openai.BadRequestError):  # refused requests must not log their prompt either
            client.completions.create(model=MODEL, prompt=f"refused {MARKER}", max_tokens=3,
                                      extra_body={"stop": ["s"] * 10_000})
        r = httpx.post(server.url + "/tokenize", json={"prompt": f"tokenize {MARKER}"}, headers=headers)
        assert r.status_code == 200
    time.sleep(0.2)  # the log line of the last stream is written as it closes
    assert MARKER not in public.output()
    logged = [ln for ln in locked.output().splitlines() if MARKER in ln]
    assert any(f"completion {MARKER}" in ln and "outputs" in ln for ln in logged), logged
    assert any(f"chat {MARKER}" in ln for ln in logged), logged


# ---- no request field reads a local path ---------------------------------------------------------

def test_no_request_field_reads_a_local_path(public):
    if not os.path.exists("/etc/passwd"):
        pytest.skip("needs /etc/passwd as the file to try to read")
    with open("/etc/passwd") as f:
        secret = f.readline().strip()
    url, msgs = public.url, [{"role": "user", "content": "hi"}]

    def post(path, body):
        r = httpx.post(url + path, json={"model": MODEL, "max_tokens": 3, **body}, timeout=60)
        assert secret not in r.text, (path, body)
        return r

    # the model is chosen by the server: a path is an unknown model name, never loaded
    assert post("/v1/completions", {"model": "/etc/passwd", "prompt": "hi"}).status_code == 404
    for part in ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
                 {"type": "input_audio", "input_audio": {"data": "/etc/passwd", "format": "wav"}},
                 {"type": "file", "file": {"file_id": "/etc/passwd"}}):
        r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": [part]}]})
        assert r.status_code == 400, (part, r.text)
    # a template from the request is refused (server-side --chat-template only), whatever it includes
    r = post("/v1/chat/completions", {"messages": msgs, "chat_template": "{% include '/etc/passwd' %}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    # a JSON schema that points at a file is refused, never fetched (post() checks the file is nowhere in it)
    schema = {"$ref": "file:///etc/passwd"}
    r = post("/v1/chat/completions", {"messages": msgs, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 400 and "$ref" in r.json()["error"]["message"], r.text
    # paths in text fields are just text: documents and prompts are rendered/tokenized as given
    r = httpx.post(url + "/tokenize", json={"messages": msgs, "documents": [{"title": "/etc/passwd",
                                                                            "text": "file:///etc/passwd"}]})
    assert r.status_code in (200, 400) and secret not in r.text
    r = post("/v1/completions", {"prompt": "/etc/passwd"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
        httpx.post(url + "/tokenize", json={"prompt": "/etc/passwd"}).json()["tokens"])


# ---- hostile sizes -------------------------------------------------------------------------------

def test_bodies_over_the_cap_are_413_declared_or_chunked(locked, public):
    client = openai.OpenAI(base_url=locked.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt="word " * 20_000, max_tokens=1)  # 100 KB > 64 KiB
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"

    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(20):
            yield b"x" * 5000
        yield b'"}'

    r = httpx.post(locked.url + "/v1/completions", content=chunks(), headers=auth())  # no Content-Length
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    # under the cap: served as usual
    assert client.completions.create(model=MODEL, prompt="word " * 100, max_tokens=1).choices[0].text is not None
    # the default cap, 32 MiB
    t0 = time.perf_counter()
    r = httpx.post(public.url + "/v1/completions", content=b" " * (32 * 2**20 + 1),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "33554432" in r.json()["error"]["message"]
    assert time.perf_counter() - t0 < 10


def _chat(**kw):
    return {"messages": [{"role": "user", "content": "hi"}], **kw}


HOSTILE = {  # name: (path, body, status, param)
    "n": ("/v1/completions", {"prompt": "hi", "n": 10**9}, 400, "n"),
    "chat n": ("/v1/chat/completions", _chat(n=10**9), 400, "n"),
    "beam n": ("/v1/completions", {"prompt": "hi", "n": 10**9, "use_beam_search": True}, 400, "n"),
    "best_of": ("/v1/completions", {"prompt": "hi", "best_of": 10**9, "use_beam_search": True}, 400, None),
    "logprobs": ("/v1/completions", {"prompt": "hi", "logprobs": 10**6}, 400, "logprobs"),
    "top_logprobs": ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=10**6), 400, "top_logprobs"),
    "logit_bias": ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(10**6)}}, 400,
                   None),
    "stop": ("/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(10**5)]}, 400, "stop"),
    "stop_token_ids": ("/v1/completions", {"prompt": "hi", "stop_token_ids": list(range(10**5))}, 400,
                       "stop_token_ids"),
    "bad_words": ("/v1/completions", {"prompt": "hi", "bad_words": [f"w{i}" for i in range(10**5)]}, 400,
                  "bad_words"),
    # 1,024 bad words of 28 KB, or 3 million allowed ids, stalled every other request for ~15 s
    "bad word length": ("/v1/completions", {"prompt": "hi", "bad_words": ["a", "word " * 205]}, 400, "bad_words"),
    "allowed_token_ids": ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [7] * (2**18 + 1)}, 400,
                          "allowed_token_ids"),
    "messages": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}] * 10**6}, 400,
                 "messages"),
    "prompt list": ("/v1/completions", {"prompt": ["hi"] * 10**5}, 400, "prompt"),
    "prompt tokens": ("/v1/completions", {"prompt": [5] * 10**6}, 400, None),
    "max_tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": 10**18}, 400, "max_tokens"),
    "embedding inputs": ("/v1/embeddings", {"input": ["hi"] * 10**5}, 400, "input"),
    "responses input": ("/v1/responses", {"input": [{"role": "user", "content": "a"}] * 10**5}, 400, "input"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_sizes_are_refused_fast(name, public):
    path, body, status, param = HOSTILE[name]
    data = json.dumps({"model": MODEL, "max_tokens": 4, **body}, separators=(",", ":")).encode()
    t0 = time.perf_counter()
    r = httpx.post(public.url + path, content=data, headers={"Content-Type": "application/json"}, timeout=120)
    elapsed = time.perf_counter() - t0
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    # 10**6 messages is 29 MiB of JSON that must be parsed before it can be counted
    assert elapsed < (30 if name == "messages" else 10), elapsed
    assert httpx.get(public.url + "/health", timeout=5).status_code == 200
    m = public.metrics()
    assert m["pagellm:num_requests_running"] == 0 and m["pagellm:kv_cache_usage_perc"] == 0
