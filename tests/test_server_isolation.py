"""Through the real server: one client's request failing in the engine step fails that request alone,
and tokenization runs off the event loop so that /health answers promptly while huge prompts are encoded.

The poison needs a request that passes validation and still fails in the step; validation now refuses
every such input we know of, so the server runs with a test-only fault (a sitecustomize on its
PYTHONPATH): the sampler raises for rows whose seed is POISON_SEED, as a buggy logits processor would.
"""

import asyncio
import os
import statistics
import time

import httpx
import openai
import pytest
from polling import async_wait_until
from test_server import MODEL, Server

# one tiny server, ~40 small requests and 6 huge prompts: well under a minute
pytestmark = pytest.mark.timeout(240)

POISON_SEED = 4242
_HOOK = f'''
from pagellm.sample import sampler

_call = sampler.Sampler.__call__


def call(self, logits, rows):
    if any(r.params.seed == {POISON_SEED} for r in rows):
        raise RuntimeError("injected fault: this request's logits processor is broken")
    return _call(self, logits, rows)


sampler.Sampler.__call__ = call
'''


@pytest.fixture(scope="module")
def server(tiny_hf_model, smollm_gguf_path, tmp_path_factory):
    path = tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024)
    hook = tmp_path_factory.mktemp("hook")
    (hook / "sitecustomize.py").write_text(_HOOK)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(hook), *([old] if old else [])])
    try:
        s = Server(["--model", path, "--tokenizer", smollm_gguf_path, "--served-model-name", MODEL,
                    "--kv-cache-memory", "16MiB"], tmp_path_factory.mktemp("srv") / "server.log")
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.output()[-3000:]


def _kv_idle(server) -> bool:
    m = server.metrics()
    return m["pagellm:num_requests_running"] == 0 and m["pagellm:kv_cache_usage_perc"] == 0


async def _one(client, i: int, seed: int | None = None):
    """Request i of 16: completions or chat, streaming or not, greedy or seeded; returns its text."""
    kw = dict(model=MODEL, max_tokens=10, temperature=0.0 if i % 2 == 0 and seed is None else 1.0)
    kw["seed"] = seed if seed is not None else (None if i % 2 == 0 else 1000 + i)
    stream = i % 4 in (1, 2)
    if i % 3 == 0:
        msgs = [{"role": "user", "content": f"Tell me about number {i}."}]
        if not stream:
            return (await client.chat.completions.create(messages=msgs, **kw)).choices[0].message.content
        chunks = await client.chat.completions.create(messages=msgs, stream=True, **kw)
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    prompt = f"Request {i}: the quick brown fox"
    if not stream:
        return (await client.completions.create(prompt=prompt, **kw)).choices[0].text
    chunks = await client.completions.create(prompt=prompt, stream=True, **kw)
    return "".join([c.choices[0].text async for c in chunks])


def test_a_poisoned_request_fails_alone_among_16(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        clean = await asyncio.gather(*[_one(client, i) for i in range(16)])
        await async_wait_until(lambda: _kv_idle(server), timeout=10, what="engine idle after the clean run")
        # the 16 again, with poisoned requests (chat and completions, streaming or not) in the same batches
        results = await asyncio.gather(*[_one(client, i) for i in range(16)],
                                       *[_one(client, i, seed=POISON_SEED) for i in (1, 3, 7, 9)],
                                       return_exceptions=True)
        await async_wait_until(lambda: _kv_idle(server), timeout=10, what="every KV block freed")
        await client.close()
        return clean, results[:16], results[16:]

    clean, again, poisoned = asyncio.run(main())
    assert again == clean  # the same texts, as if the poison had not been there
    for e in poisoned:
        assert isinstance(e, openai.APIError), e
        assert "injected fault" in e.message and "sampling failed for this request" in e.message, e.message
    assert sum(isinstance(e, openai.InternalServerError) for e in poisoned) == 2  # non-streaming: a 500
    m = server.metrics()
    assert m['pagellm:request_success_total{finished_reason=error}'] == 4
    assert "engine step failed" not in server.output()  # no _fail_all: nobody else was aborted


def test_health_answers_quickly_while_huge_prompts_are_tokenized(server):
    words = "lorem ipsum dolor sit amet, consectetur adipiscing elit; "
    huge = words * 12500  # ~100k tokens, ~700 KB: refused as too long, but only after tokenization

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            async def big(i: int):
                t0 = time.perf_counter()
                if i % 2:
                    r = await http.post("/v1/chat/completions", json={
                        "model": MODEL, "messages": [{"role": "user", "content": huge}], "max_tokens": 1})
                else:
                    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": huge, "max_tokens": 1})
                return r, time.perf_counter() - t0

            tasks = [asyncio.create_task(big(i)) for i in range(6)]
            latencies = []
            while not all(t.done() for t in tasks):
                t0 = time.perf_counter()
                assert (await http.get("/health")).status_code == 200
                latencies.append(time.perf_counter() - t0)
                await asyncio.sleep(0.01)
            return [t.result() for t in tasks], latencies

    bigs, latencies = asyncio.run(main())
    for r, _ in bigs:
        assert r.status_code == 400 and "max_model_len is 1024" in r.json()["error"]["message"], r.text
    busy = max(s for _, s in bigs)
    p90 = statistics.quantiles(latencies, n=10)[-1]
    print(f"\n6 huge prompts answered within {busy:.2f} s; /health polled {len(latencies)} times: "
          f"median {statistics.median(latencies) * 1000:.1f} ms, p90 {p90 * 1000:.1f} ms, "
          f"max {max(latencies) * 1000:.1f} ms")
    assert len(latencies) >= 10  # the polls overlapped the tokenization
    # Measured on a loaded 2-core machine: median 2-6 ms, max 80-150 ms (350 ms once, with two soak servers
    # on the same cores). With tokenizers' encode (which holds the GIL) it was 10 polls in 1.6 s, max 750 ms:
    # the p90 bound is what catches that; the max bound only catches a stall of a whole second.
    assert p90 < 0.1
    assert max(latencies) < 1.0
