"""Prompt logprobs (SamplingParams.prompt_logprobs) equal transformers' log-softmax of the same prompt, with
chunked prefill, a prefix-cache hit, n > 1, preemption by recompute and beam search."""

import random

import pytest
import torch

from pagellm import LLM, SamplingParams

# tiny models on 2 CPU cores; the transformers reference is computed once per module
pytestmark = pytest.mark.timeout(180)

TOP = 5


@pytest.fixture(scope="module")
def tiny_path(tiny_hf_model):
    return tiny_hf_model("llama")


@pytest.fixture(scope="module")
def hf(tiny_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


def prompts(n, seed=0, lo=20, hi=70):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# Logprobs agree with transformers' to this; so a rank is only defined up to the logits within it of the token's
# (a random tiny model has near-ties: a different float32 GEMM kernel, e.g. another CPU's OpenBLAS, reorders them).
LOGPROB_TOL = 1e-4


def reference(hf, prompt):
    """(logprob of prompt token j, its (lowest, highest) rank within LOGPROB_TOL, top-N ids) for j >= 1, from one
    transformers forward."""
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    out = []
    for j in range(1, len(prompt)):
        row, tok = lp[j - 1], prompt[j]
        ranks = (int((row > row[tok] + LOGPROB_TOL).sum()) + 1, int((row > row[tok] - LOGPROB_TOL).sum()))
        out.append((float(row[tok]), ranks, row.topk(TOP).indices.tolist()))
    return out


def check(entries, prompt, ref):
    assert len(entries) == len(prompt) and entries[0] is None
    for j, (entry, (lp, (lowest, highest), top)) in enumerate(zip(entries[1:], ref, strict=True), start=1):
        tok = prompt[j]
        assert abs(entry[tok].logprob - lp) < LOGPROB_TOL, (j, entry[tok].logprob, lp)
        assert lowest <= entry[tok].rank <= highest, (j, entry[tok].rank, lowest, highest)
        ranked = sorted((t for t, e in entry.items() if e.rank <= TOP), key=lambda t: entry[t].rank)
        assert ranked == top, j
        assert len(entry) in (TOP, TOP + 1)  # the top-N, plus the prompt token when it is not among them
        assert all(isinstance(e.decoded_token, str) for e in entry.values())


def params(**kw):
    return SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOP, **kw)


def test_equal_transformers_whole_and_chunked(tiny_path, hf, smollm_gguf_path):
    ps = prompts(4)
    refs = [reference(hf, p) for p in ps]
    whole = LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory="4MiB")
    for out, p, ref in zip(whole.generate(ps, params(), use_tqdm=False), ps, refs, strict=True):
        check(out.prompt_logprobs, p, ref)
    # Chunks of 16 tokens shared by 4 prompts: each prompt is scored across several steps and batches.
    chunked = LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory="4MiB", max_num_batched_tokens=16,
                  block_size=4)
    outs = chunked.generate(ps, params(), use_tqdm=False)
    for out, p, ref in zip(outs, ps, refs, strict=True):
        check(out.prompt_logprobs, p, ref)
    # Asking for prompt logprobs changes nothing about the generated tokens.
    plain = chunked.generate(ps, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)


def test_prefix_cache_hit_still_gets_them(tiny_path, hf, smollm_gguf_path):
    llm = LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory="4MiB", block_size=4,
              enable_prefix_caching=True)
    kv = llm.engine.kv_cache
    (p,) = prompts(1, seed=3)
    llm.generate(p, SamplingParams(max_tokens=1), use_tqdm=False)  # publishes the prompt's blocks
    hits = kv.prefix_hits
    llm.generate(p, SamplingParams(max_tokens=1), use_tqdm=False)
    assert kv.prefix_hits > hits  # a plain request does hit the cache
    hits = kv.prefix_hits
    (out,) = llm.generate(p, params(), use_tqdm=False)
    check(out.prompt_logprobs, p, reference(hf, p))
    assert kv.prefix_hits == hits  # recomputed, not read from the cache
    # ...and its blocks were still published for the next plain request.
    llm.generate(p, SamplingParams(max_tokens=1), use_tqdm=False)
    assert kv.prefix_hits > hits


def test_n_samples_share_one_computation(tiny_path, hf, smollm_gguf_path):
    llm = LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory="4MiB")
    (p,) = prompts(1, seed=4)
    engine = llm.engine
    engine.add_request("r", p, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, prompt_logprobs=TOP))
    seqs = [s.request for s in engine.requests["r"].seqs]
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    check(final.prompt_logprobs, p, reference(hf, p))
    assert len(final.outputs) == 3
    # Only the first sequence computed the prompt's rows; its siblings forked after it.
    assert len(seqs[0].prompt_logprob_rows) == len(p) - 1
    assert [len(s.prompt_logprob_rows) for s in seqs[1:]] == [0, 0]


def test_preemption_by_recompute_never_doubles_them(tiny_path, hf, smollm_gguf_path):
    # 24 blocks of 4 tokens for 6 prompts of 20-40 tokens + 20 outputs each: requests are preempted
    # (some mid-prefill, in chunks of 8) and recomputed.
    llm = LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory=24 * 1024, block_size=4,
              max_num_batched_tokens=8, enable_prefix_caching=True)
    ps = prompts(6, seed=5, lo=20, hi=40)
    outs = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=TOP),
                        use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    for out, p in zip(outs, ps, strict=True):
        check(out.prompt_logprobs, p, reference(hf, p))


def test_beam_search_reports_them(tiny_path, hf, smollm_gguf_path):
    llm = LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory="4MiB")
    (p,) = prompts(1, seed=6)
    (out,) = llm.generate(p, SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=4,
                                            prompt_logprobs=TOP), use_tqdm=False)
    check(out.prompt_logprobs, p, reference(hf, p))
    assert len(out.outputs) == 2


def test_one_token_prompt_and_zero_top(tiny_path, smollm_gguf_path):
    llm = LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory="4MiB")
    (one, two) = llm.generate([[7], [7, 9]], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    assert one.prompt_logprobs == [None]
    assert two.prompt_logprobs[0] is None and list(two.prompt_logprobs[1]) == [9]
    assert two.prompt_logprobs[1][9].rank >= 1


# ---- over HTTP: echo + logprobs, max_tokens 0, vLLM's prompt_logprobs ------------------------------

SERVED = "tiny"


@pytest.fixture(scope="module")
def wide_path(tiny_hf_model):
    return tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024)  # any SmolLM2 token is valid


@pytest.fixture(scope="module")
def server(wide_path, smollm_gguf_path, tmp_path_factory):
    from test_server import Server

    with Server.running(["--model", wide_path, "--tokenizer", smollm_gguf_path, "--served-model-name", SERVED,
                         "--kv-cache-memory", "16MiB"], tmp_path_factory.mktemp("srv") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):

    return server.client()


@pytest.fixture(scope="module")
def wide_llm(wide_path, smollm_gguf_path):
    return LLM(wide_path, tokenizer=smollm_gguf_path, kv_cache_memory="16MiB")


PROMPT = "The capital of France is Paris, and the capital of Spain is"


def test_echo_with_logprobs_scores_the_prompt(client, wide_llm):
    (ref,) = wide_llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2, logprobs=2),
                               use_tqdm=False)
    ids = ref.prompt_token_ids
    r = client.completions.create(model=SERVED, prompt=PROMPT, echo=True, logprobs=2, max_tokens=4, temperature=0)
    c = r.choices[0]
    assert c.text == PROMPT + ref.outputs[0].text
    lp = c.logprobs
    n = len(ids)
    assert len(lp.tokens) == n + len(ref.outputs[0].token_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, n):
        entry = ref.prompt_logprobs[j]
        assert abs(lp.token_logprobs[j] - entry[ids[j]].logprob) < 1e-4
        assert lp.tokens[j] == entry[ids[j]].decoded_token
        assert 2 <= len(lp.top_logprobs[j]) <= 3
    assert "".join(lp.tokens[:n]) == PROMPT
    assert lp.text_offset[:n] == [len("".join(lp.tokens[:j])) for j in range(n)]
    assert lp.text_offset[n] == len(PROMPT)
    plain = client.completions.create(model=SERVED, prompt=PROMPT, logprobs=2, max_tokens=4, temperature=0)
    assert lp.tokens[n:] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    # streamed: the first chunk carries the prompt and its entries; the chunks add up to the same lists
    chunks = list(client.completions.create(model=SERVED, prompt=PROMPT, echo=True, logprobs=2, max_tokens=4,
                                            temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    streamed = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert [o for ch in chunks if ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset] == lp.text_offset


def test_max_tokens_zero_with_echo_generates_nothing(client, server):
    import httpx

    r = client.completions.create(model=SERVED, prompt=[PROMPT, "Hello"], echo=True, logprobs=1, max_tokens=0,
                                  temperature=0)
    assert [c.text for c in r.choices] == [PROMPT, "Hello"]
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens > 0
    assert all(c.finish_reason == "length" for c in r.choices)
    assert "".join(r.choices[0].logprobs.tokens) == PROMPT
    assert r.choices[0].logprobs.token_logprobs[0] is None and None not in r.choices[0].logprobs.token_logprobs[1:]
    chunks = list(client.completions.create(model=SERVED, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0,
                                            stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == PROMPT
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_vllm_prompt_logprobs_field(client, server, wide_llm):
    import httpx

    (ref,) = wide_llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3),
                               use_tqdm=False)
    ids = ref.prompt_token_ids
    r = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 3})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for j in range(1, len(ids)):
        got = plp[j][str(ids[j])]
        assert abs(got["logprob"] - ref.prompt_logprobs[j][ids[j]].logprob) < 1e-4
        assert got["rank"] == ref.prompt_logprobs[j][ids[j]].rank >= 1
        assert got["decoded_token"] == ref.prompt_logprobs[j][ids[j]].decoded_token
        assert {v["rank"] for v in plp[j].values()} >= {1, 2, 3}
    chat = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:]) and len(entries) == chat.usage.prompt_tokens
    for path, body in [("/v1/completions", {"prompt": PROMPT, "stream": True, "prompt_logprobs": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                                 "prompt_logprobs": 1}),
                       ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}),
                       ("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 21})]:
        bad = httpx.post(server.url + path, json=body)
        assert bad.status_code == 400, (path, body, bad.text)
        assert bad.json()["error"]["param"] in ("prompt_logprobs", "logprobs"), bad.text


def test_async_client_echo_logprobs(server):
    import asyncio

    import openai

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as aclient:
            rs = await asyncio.gather(*(aclient.completions.create(model=SERVED, prompt=f"{PROMPT} {i}", echo=True,
                                                                   logprobs=1, max_tokens=1, temperature=0)
                                        for i in range(4)))
        return rs

    for r in asyncio.run(main()):
        lp = r.choices[0].logprobs
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == r.usage.total_tokens
