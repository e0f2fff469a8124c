"""A second server, on SmolLM2 itself: meaningful text, the API key, the queue limit, the request timeout
and a clean SIGTERM shutdown (split from test_server.py, whose `Server` runs it)."""

import asyncio
import json
import signal

import httpx
import openai
import pytest
from polling import async_wait_until
from test_server import Server

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def smol(smollm_gguf_path, tmp_path_factory):
    s = Server(["--api-key", "sekrit", "--max-num-seqs", "1", "--max-queue-len", "1", "--request-timeout", "3",
                "--shutdown-timeout", "0.5", "--served-model-name", "smol"],
               tmp_path_factory.mktemp("smol") / "server.log")
    yield s
    s.stop()


@pytest.mark.slow
def test_smollm_answers_and_requires_the_key(smol):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=smol.url + "/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.get(smol.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    client = openai.OpenAI(base_url=smol.url + "/v1", api_key="sekrit", max_retries=0)
    r = client.chat.completions.create(model="smol", temperature=0, max_tokens=20,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content


@pytest.mark.slow
def test_smollm_queue_limit_and_timeout(smol):
    auth = {"Authorization": "Bearer sekrit"}
    long = {"model": "smol", "prompt": "Count:", "max_tokens": 2000, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=smol.url, headers=auth, timeout=30) as c:
            async with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as running:
                lines = running.aiter_lines()
                await anext(lines)  # it runs; max-num-seqs 1 makes the next one wait
                waiting = asyncio.ensure_future(c.post("/v1/completions", json=long))
                await async_wait_until(lambda: smol.metrics()["pagellm:num_requests_waiting"] >= 1,
                                       interval=0.02, what="second request waiting")
                full = await c.post("/v1/completions", json=long)
                assert full.status_code == 503 and full.headers["retry-after"]
                assert full.json()["error"]["code"] == "queue_full"
                events = [ln async for ln in lines if ln.startswith("data:")]
            timed_out = await waiting
        return events, timed_out

    events, timed_out = asyncio.run(main())
    # The streaming request hit --request-timeout: an error event, then [DONE].
    assert json.loads(events[-2][5:])["error"]["code"] == "timeout" and events[-1] == "data: [DONE]"
    assert timed_out.status_code == 408 and timed_out.json()["error"]["code"] == "timeout"


@pytest.mark.slow
def test_smollm_embeddings_of_many_inputs_time_out_and_leave_nothing_behind(smol):
    """--request-timeout holds for /v1/embeddings too, and its inputs not yet embedded are dropped: they run
    between steps a slice at a time (engine/embedding.py JOB_SLICE_S), not all before the next step, so the
    next request is answered at once instead of waiting for them (or timing out behind them)."""
    auth = {"Authorization": "Bearer sekrit"}
    r = httpx.post(smol.url + "/v1/embeddings", headers=auth, timeout=60,
                   json={"model": "smol", "input": ["hello " * 400] * 200})  # ~80k tokens: minutes here
    assert r.status_code == 408 and r.json()["error"]["code"] == "timeout", r.text
    ok = httpx.post(smol.url + "/v1/completions", headers=auth, timeout=60,
                    json={"model": "smol", "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    metrics = smol.metrics()
    assert metrics["pagellm:kv_cache_usage_perc"] == 0 and metrics["pagellm:num_requests_running"] == 0


@pytest.mark.slow
def test_smollm_sigterm_finishes_streams_and_exits_cleanly(smol):
    body = {"model": "smol", "prompt": "Count:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", smol.url + "/v1/completions", json=body, timeout=30,
                      headers={"Authorization": "Bearer sekrit"}) as r:
        lines = r.iter_lines()
        next(lines)
        smol.proc.send_signal(signal.SIGTERM)
        events = [ln for ln in lines if ln.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][5:])["choices"][0]["finish_reason"] == "abort"
    assert smol.proc.wait(30) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(smol.url + "/health")
