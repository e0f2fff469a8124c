"""The OpenAI-compatible server, run for real in a subprocess and driven with the official openai client.

Most tests share one server on a tiny random Llama (SmolLM2's tokenizer, so any text is a valid prompt);
tests/test_server_smollm.py runs a second one on SmolLM2 itself (meaningful text, the API key, the queue
limit, the request timeout and a clean SIGTERM shutdown). Other test modules import `Server` and the
module-scoped fixtures from here.
"""

import asyncio
import contextlib
import io
import os
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagellm import LLM, SamplingParams

MODEL = "tiny"
GREEDY = dict(temperature=0.0, max_tokens=12)


class Server:
    def __init__(self, args: list[str], log_path):
        self.log_path = log_path
        self.log = open(log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "pagellm.cli", "serve", "--port", "0", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = self._wait_ready()

    def _wait_ready(self, timeout: float = 180.0) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = re.search(r"ready: serving \S+ at (http://\S+)/v1", self.output())
            if m:
                assert httpx.get(m.group(1) + "/health").status_code == 200
                return m.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server did not start:\n{self.output()[-3000:]}")

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        """Sample name (with labels other than model_name and engine, which every series has) -> value."""
        text = httpx.get(self.url + "/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                  if k not in ("model_name", "engine"))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)

    @classmethod
    @contextlib.contextmanager
    def running(cls, args: list[str], log_path):
        """A server for a module's tests: stopped afterwards, and it must have exited cleanly (code 0)."""
        s = cls(args, log_path)
        try:
            yield s
        finally:
            s.stop()
        assert s.proc.returncode == 0, s.output()[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def tiny_path(tiny_hf_model):
    return tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def server(tiny_path, smollm_gguf_path, tmp_path_factory):
    with Server.running(["--model", tiny_path, "--tokenizer", smollm_gguf_path, "--served-model-name", MODEL, "alias",
                         "--kv-cache-memory", "16MiB"], tmp_path_factory.mktemp("srv") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def llm(tiny_path, smollm_gguf_path):
    return LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory="16MiB")


def wait_idle(server, within: float = 1.0) -> dict:
    deadline = time.time() + within
    while True:
        m = server.metrics()
        idle = m["pagellm:num_requests_running"] == 0 and m["pagellm:kv_cache_usage_perc"] == 0
        if idle or time.time() > deadline:
            return m
        time.sleep(0.05)


# ---- discovery -----------------------------------------------------------------------------------

def test_models_health_tokenize(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, "alias"]
    assert httpx.get(server.url + "/health").status_code == 200
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 1024
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 3


# ---- completions ---------------------------------------------------------------------------------

def test_greedy_completion_equals_llm_generate(client, llm):
    prompt = "The quick brown fox"
    expected = llm.generate(prompt, SamplingParams(**GREEDY), use_tqdm=False)[0]
    r = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    assert r.choices[0].text == expected.outputs[0].text
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    by_ids = client.completions.create(model="alias", prompt=expected.prompt_token_ids, **GREEDY)
    assert by_ids.choices[0].text == expected.outputs[0].text
    batch = client.completions.create(model=MODEL, prompt=[expected.prompt_token_ids, [7, 8, 9]], **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == expected.outputs[0].text


def test_streaming_completion_equals_non_streaming(client):
    kw = dict(model=MODEL, prompt="Once upon a time", temperature=0.0, max_tokens=20,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_several_prompts_with_n_and_seed(client):
    kw = dict(model=MODEL, prompt=["a b c", "d e f"], n=2, temperature=1.0, seed=7, max_tokens=6,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 4 * 6
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # same seed, same samples
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(4)] == [c.text for c in sorted(r.choices, key=lambda c: c.index)]


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0.0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) >= 3 for top in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    for top, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True):
        assert abs(max(top.values()) - chosen) < 1e-5


def test_stop_string_and_echo(client):
    kw = dict(model=MODEL, prompt="Tell me a story", temperature=0.0, max_tokens=30,
              extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    stop = text[8:11]
    assert len(stop) == 3
    expected = text[:text.index(stop)]
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kw))
    assert streamed == expected
    echo = client.completions.create(echo=True, **dict(kw, max_tokens=3))
    assert echo.choices[0].text.startswith("Tell me a story")


# ---- chat ----------------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Say something."}]}]


def test_llm_chat_takes_vllm_s_templating_arguments(client, llm):
    """LLM.chat as vLLM's: continue_final_message (the same output as the server's), a chat_template with
    chat_template_kwargs and tools reaching it; each output's prompt is the rendered text (it was None)."""
    msgs = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": "Well,"}]
    p = SamplingParams(temperature=0.0, max_tokens=8)
    out = llm.chat(msgs, p, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt == llm.get_tokenizer().apply_chat_template(msgs, add_generation_prompt=False,
                                                                 continue_final_message=True)
    assert out.prompt.endswith("Well,")
    r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0.0, max_tokens=8,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert r.choices[0].message.content == out.outputs[0].text
    custom = "{% for m in messages %}{{ m['content'] }}|{{ greeting }}|{{ tools[0]['function']['name'] }}{% endfor %}"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = llm.chat(msgs[:1], p, use_tqdm=False, chat_template=custom, chat_template_kwargs={"greeting": "hi"},
                   tools=tools)[0]
    assert out.prompt == "Say something.|hi|get_weather"
    with pytest.raises(ValueError, match="chat_template_kwargs must not set tools"):
        llm.chat(msgs[:1], p, chat_template_kwargs={"tools": []})
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(msgs, p, continue_final_message=True)  # add_generation_prompt stays True by default


def test_chat_greedy_equals_llm_chat_stream_and_not(client, llm):
    expected = llm.chat([{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": "Say something."}],
                        SamplingParams(temperature=0.0, max_tokens=15), use_tqdm=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0.0, max_completion_tokens=15)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.outputs[0].text
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0.0, max_tokens=15,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    assert body[-1].choices[0].finish_reason == expected.outputs[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in body) == expected.outputs[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_logprob_bytes_join_into_multibyte_characters(client):
    """A token that is a piece of a character shows as U+FFFD, and its `bytes` are the piece (OpenAI's; they
    were the bytes of U+FFFD): joined, the content's UTF-8, streamed or not."""
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=40, logprobs=True, top_logprobs=1, temperature=0,
              extra_body={"guided_choice": ["🙂 日本語 naïve"]})
    content = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert any(t.token == "\ufffd" for t in content) and content[-1].token == "<|im_end|>"  # the end: EOS's entry
    assert b"".join(bytes(t.bytes) for t in content[:-1]).decode() == "🙂 日本語 naïve"
    streamed = [t for chunk in client.chat.completions.create(stream=True, **kw) for c in chunk.choices
                if c.logprobs for t in c.logprobs.content]
    assert [t.bytes for t in streamed] == [t.bytes for t in content]


def test_chat_n_logprobs_and_seed(client):
    kw = dict(model=MODEL, messages=MESSAGES, n=3, seed=11, temperature=0.9, max_tokens=8, logprobs=True,
              top_logprobs=2, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert len(c.logprobs.content) == 8
        assert all(len(t.top_logprobs) == 2 and t.bytes is not None for t in c.logprobs.content)
    assert [c.message.content for c in client.chat.completions.create(**kw).choices] == \
           [c.message.content for c in r.choices]
    streamed = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            entry = streamed.setdefault(c.index, {"text": "", "lps": 0})
            entry["text"] += c.delta.content or ""
            entry["lps"] += len(c.logprobs.content) if c.logprobs else 0
    assert [streamed[i]["text"] for i in range(3)] == [c.message.content for c in r.choices]
    assert all(streamed[i]["lps"] == 8 for i in range(3))


# ---- concurrency and disconnects -----------------------------------------------------------------

def test_32_concurrent_streaming_clients(server):
    async def one(client, i):
        text, finish = "", None
        stream = await client.completions.create(model=MODEL, prompt=f"Request number {i}:", max_tokens=10 + i,
                                                 temperature=0.5, seed=i, stream=True,
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return finish

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    before = server.metrics()
    assert asyncio.run(main()) == ["length"] * 32
    after = wait_idle(server)
    assert after["pagellm:request_success_total{finished_reason=length}"] - \
           before["pagellm:request_success_total{finished_reason=length}"] == 32
    assert after["pagellm:generation_tokens_total"] - before["pagellm:generation_tokens_total"] == \
           sum(10 + i for i in range(32))


def test_client_closing_a_stream_frees_its_blocks(server):
    body = {"model": MODEL, "prompt": "x " * 50, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.metrics()["pagellm:num_requests_running"] == 1
    m = wait_idle(server, within=1.0)
    assert m["pagellm:num_requests_running"] == 0 and m["pagellm:kv_cache_usage_perc"] == 0


def test_client_giving_up_on_a_non_streaming_request_frees_its_blocks(server):
    body = {"model": MODEL, "prompt": "y " * 50, "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    m = wait_idle(server, within=1.0)
    assert m["pagellm:num_requests_running"] == 0 and m["pagellm:kv_cache_usage_perc"] == 0


# ---- errors --------------------------------------------------------------------------------------

ERRORS = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": "many"}, 400, "n"),
    ("/v1/completions", {"prompt": 1.5}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": [[5] * 2000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**6]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 1100}]}, 400, "messages"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/v1/nothing-here", {}, 404, None),
]


@pytest.mark.parametrize("path,body,status,param", ERRORS, ids=[f"{e[2]}-{e[3]}" for e in ERRORS])
def test_error_objects(server, path, body, status, param):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err


def test_malformed_json_and_too_long_prompt_messages(server, client):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x",',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * 2000, max_tokens=1)
    assert "2000" in e.value.message and "1024" in e.value.message  # both lengths are named
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


def test_metrics_parse_and_move(server, client):
    before = server.metrics()
    client.completions.create(model=MODEL, prompt="count me", max_tokens=4, extra_body={"ignore_eos": True})
    after = server.metrics()
    assert after["pagellm:prompt_tokens_total"] > before["pagellm:prompt_tokens_total"]
    assert after["pagellm:generation_tokens_total"] - before["pagellm:generation_tokens_total"] == 4
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert after[f"pagellm:{h}_count"] == before[f"pagellm:{h}_count"] + 1
    assert after["pagellm:inter_token_latency_seconds_count"] - \
           before["pagellm:inter_token_latency_seconds_count"] == 3
    assert "pagellm:num_requests_waiting" in after and "pagellm:num_preemptions_total" in after
    # Prefix caching is on by default: the same long prompt again hits the cache.
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=list(range(100, 180)), max_tokens=1)
    final = server.metrics()
    assert final["pagellm:prefix_cache_queries_total"] > after["pagellm:prefix_cache_queries_total"]
    assert final["pagellm:prefix_cache_hits_total"] >= after["pagellm:prefix_cache_hits_total"] + 64


# ---- pagellm chat --------------------------------------------------------------------------------

def test_chat_cli_over_http_keeps_history(server, monkeypatch, capsys):
    from pagellm import chat_cli
    from pagellm.cli import build_parser

    seen = []
    original = chat_cli.HTTPBackend.stream

    def spy(self, messages, opts):
        seen.append([m["role"] for m in messages])
        yield from original(self, messages, opts)

    monkeypatch.setattr(chat_cli.HTTPBackend, "stream", spy)
    ns = build_parser().parse_args(["chat", "--url", server.url, "--max-tokens", "4", "--system", "Be brief."])
    stdin = io.StringIO("Hello there\nAnd again\n/reset\nFresh start\n/exit\nnever read\n")
    assert chat_cli.run_chat(ns, stdin=stdin) == 0
    assert seen == [["system", "user"], ["system", "user", "assistant", "user"], ["system", "user"]]
    assert "(conversation cleared)" in capsys.readouterr().out


def test_chat_cli_with_a_local_engine(tiny_path, smollm_gguf_path):
    r = subprocess.run([sys.executable, "-m", "pagellm.cli", "chat", "--model", tiny_path, "--tokenizer",
                        smollm_gguf_path, "--kv-cache-memory", "8MiB", "--max-tokens", "5", "--temperature", "0"],
                       input="Hi\n/exit\n", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Commands:") and len(r.stdout.strip().splitlines()) >= 2
