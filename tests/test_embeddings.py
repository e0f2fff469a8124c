"""Embeddings (LLM.embed, POST /v1/embeddings): the normalized last-token or mean final hidden state equals
transformers' (after the final norm), in chunks or whole; base64 decodes to the same floats; every KV
block comes back; the official openai client works."""

import asyncio
import base64
import functools
import struct
import time

import httpx
import openai
import pytest
import torch
from test_server import Server

from pagellm import LLM
from pagellm.engine.embedding import JOB_SLICE_S, EngineJobs

# one tiny server and a tiny offline engine; the transformers reference runs in-process
pytestmark = pytest.mark.timeout(180)

SERVED = "tiny"
TEXTS = ["The quick brown fox jumps over the lazy dog", "Hello", "Paged attention keeps KV in blocks. " * 6]


@pytest.fixture(scope="module")
def wide_path(tiny_hf_model):
    return tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def hf(wide_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(wide_path, dtype=torch.float32).eval()


def reference(hf, ids, pooling):
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
    v = h[-1] if pooling == "last" else h.mean(dim=0)
    return torch.nn.functional.normalize(v, dim=0)


@pytest.fixture(scope="module")
def llm(wide_path, smollm_gguf_path):
    # a step budget of 8 tokens: longer inputs run in several chunks
    return LLM(wide_path, tokenizer=smollm_gguf_path, kv_cache_memory="4MiB", max_num_batched_tokens=8)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_offline_embeddings_equal_transformers(llm, hf, pooling):
    tok = llm.get_tokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        got = torch.tensor(llm.embed(text, pooling=pooling)[0])
        assert torch.allclose(got, reference(hf, ids, pooling), atol=1e-4), text
        assert abs(float(got.norm()) - 1.0) < 1e-5
        assert torch.allclose(torch.tensor(llm.embed(ids, pooling=pooling)[0]), got, atol=1e-6)
    kv = llm.engine.kv_cache
    assert kv.pool.num_free == kv.num_blocks  # every block taken for an input came back
    raw = torch.tensor(llm.embed(TEXTS[0], pooling=pooling, normalize=False)[0])
    assert abs(float(raw.norm()) - 1.0) > 1e-3
    with pytest.raises(ValueError, match="out of range"):
        llm.embed([1, 49152])


@pytest.fixture(scope="module")
def server(wide_path, smollm_gguf_path, tmp_path_factory):
    with Server.running(["--model", wide_path, "--tokenizer", smollm_gguf_path, "--served-model-name", SERVED,
                         "--kv-cache-memory", "4MiB", "--max-num-batched-tokens", "16"],
                        tmp_path_factory.mktemp("srv") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_openai_client_embeddings(client, llm, hf):
    r = client.embeddings.create(model=SERVED, input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1, 2] and r.object == "list" and r.model == SERVED
    tok = llm.get_tokenizer()
    for text, d in zip(TEXTS, r.data, strict=True):
        assert len(d.embedding) == 64
        assert torch.allclose(torch.tensor(d.embedding), reference(hf, tok.encode(text), "last"), atol=1e-4)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(tok.encode(t)) for t in TEXTS)
    ids = client.embeddings.create(model=SERVED, input=[tok.encode(TEXTS[0]), tok.encode(TEXTS[1])])
    assert [d.embedding for d in ids.data] == [d.embedding for d in r.data[:2]]
    one = client.embeddings.create(model=SERVED, input=tok.encode(TEXTS[1]), encoding_format="float")
    assert one.data[0].embedding == pytest.approx(r.data[1].embedding, abs=1e-6)


def test_float_and_base64_and_mean_pooling(server, llm):
    url = server.url + "/v1/embeddings"
    floats = httpx.post(url, json={"input": TEXTS[0], "encoding_format": "float"}).json()
    b64 = httpx.post(url, json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert list(decoded) == pytest.approx(floats["data"][0]["embedding"], abs=0, rel=1e-7)
    mean = httpx.post(url, json={"input": TEXTS[2], "encoding_format": "float", "pooling": "mean"}).json()
    assert mean["data"][0]["embedding"] == pytest.approx(llm.embed(TEXTS[2], pooling="mean")[0], abs=1e-5)


def test_async_client_and_blocks_come_back(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
            gen = c.completions.create(model=SERVED, prompt="Hello there", max_tokens=8)
            return await asyncio.gather(gen, *(c.embeddings.create(model=SERVED, input=f"{t} {i}")
                                               for i, t in enumerate(TEXTS * 3)))

    results = asyncio.run(main())
    assert all(len(r.data[0].embedding) == 64 for r in results[1:])
    m = httpx.get(server.url + "/metrics").text
    usage = [line for line in m.splitlines() if line.startswith("pagellm:kv_cache_usage_perc")]
    assert usage and float(usage[0].split()[-1]) == 0.0


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "dimensions": 32}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": [[1, 49152]]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "pooling": "max"}, "pooling"),
    ({"input": "x " * 2000}, "input"),  # longer than max_model_len (1024)
    ({"input": "x", "truncate_prompt_tokens": True}, "truncate_prompt_tokens"),  # was read as 1
    ({"input": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
])
def test_bad_inputs_are_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_truncate_prompt_tokens_minus_one_keeps_the_last_max_model_len(server, llm):
    """vLLM's -1: as many of the last tokens as the context holds (a 2,000-token input is a 400 without it)."""
    long = "x " * 2000
    r = httpx.post(server.url + "/v1/embeddings", json={"input": long, "truncate_prompt_tokens": -1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == llm.engine.max_model_len
    cut = httpx.post(server.url + "/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 1024}).json()
    assert r.json()["data"][0]["embedding"] == cut["data"][0]["embedding"]


def test_the_engine_job_takes_token_ids_only(llm):
    """The server's embeddings job runs between steps in the engine core: text is tokenized (and held to the
    context) in the API process first, so the job refuses text rather than tokenize it there."""
    from pagellm.engine.embedding import embed_token_ids

    with pytest.raises(TypeError, match="takes a list of token ids, got str"):
        embed_token_ids(llm.engine, "Hello")
    ids = llm.get_tokenizer().encode(TEXTS[1])
    vec, n = embed_token_ids(llm.engine, ids)
    assert n == len(ids) and vec == pytest.approx(llm.embed(TEXTS[1])[0], abs=1e-6)


def _slow_job(i, engine):
    time.sleep(JOB_SLICE_S * 0.6)
    return i


def test_jobs_run_between_steps_a_slice_at_a_time():
    """Many inputs are many jobs: one round between two steps runs those that fit JOB_SLICE_S (at least one), in
    order, so running requests keep stepping beside a large embeddings request; what a client gave up is
    dropped before it runs."""
    async def main():
        jobs = EngineJobs()
        futs = [jobs.submit(functools.partial(_slow_job, i)) for i in range(6)]
        jobs.run(None)
        await asyncio.sleep(0.01)  # the results are settled through the event loop
        first = [f.done() for f in futs]
        futs[-1].cancel()  # its client left
        rounds = 1
        while jobs:
            jobs.run(None)
            rounds += 1
            await asyncio.sleep(0.01)
        return first, rounds, [f.result() for f in futs[:-1]], futs[-1].cancelled()

    first, rounds, results, cancelled = asyncio.run(main())
    assert first[0] and not all(first) and first == sorted(first, reverse=True), first
    assert results == [0, 1, 2, 3, 4] and cancelled and rounds >= 3
