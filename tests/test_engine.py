"""Engine behaviour on a tiny random Llama: batching invariance, preemption, stops, seeds, bad input."""

import collections
import os
import random

import pytest

from pagellm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tiny_hf_model):
    return tiny_hf_model("llama", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def make_llm(tiny_path, smollm_gguf_path):
    def make(**kw):
        kw.setdefault("kv_cache_memory", "8MiB")
        return LLM(tiny_path, tokenizer=smollm_gguf_path, **kw)

    return make


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm()


def prompts(n, seed=0, lo=5, hi=120):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy_ids(llm, ps, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]


def assert_all_blocks_free(llm):
    kv = llm.engine.kv_cache
    assert kv.pool.num_free == kv.num_blocks and not kv.req_blocks
    assert not llm.engine.scheduler.has_unfinished_requests()


def test_chunked_prefill_on_and_off_agree(make_llm):
    ps = prompts(8, seed=1, lo=40, hi=200)
    chunked = greedy_ids(make_llm(max_num_batched_tokens=32), ps)
    whole = greedy_ids(make_llm(enable_chunked_prefill=False, max_num_batched_tokens=32), ps)
    assert chunked == whole


def test_preemption_keeps_greedy_output(make_llm, llm):
    ps = prompts(12, seed=2, lo=60, hi=120)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = greedy_ids(llm, ps, params)
    # 40 blocks of 16 tokens: a few requests fit at a time, growth forces preemption.
    small = make_llm(kv_cache_memory=40 * 16 * 2 * 2 * 2 * 16 * 4, block_size=16)
    assert small.engine.kv_cache.num_blocks == 40
    assert greedy_ids(small, ps, params) == expected
    assert small.engine.scheduler.stats.num_preemptions > 0
    assert_all_blocks_free(small)


def test_one_prompt_alone_equals_inside_a_batch_of_32(llm):
    target = prompts(1, seed=3)[0]
    alone = greedy_ids(llm, [target])[0]
    others = prompts(32, seed=4)
    batch = others[:16] + [target] + others[16:]
    assert greedy_ids(llm, batch)[16] == alone


def test_64_concurrent_random_requests_finish_and_free_every_block(llm):
    rng = random.Random(5)
    ps = prompts(64, seed=5, lo=1, hi=300)
    params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(1, 60),
                             ignore_eos=True, seed=i) for i in range(64)]
    outs = llm.generate(ps, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert_all_blocks_free(llm)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=15, seed=1234, ignore_eos=True)
    target = prompts(1, seed=6)[0]
    alone = greedy_ids(llm, [target], p)[0]
    others = prompts(5, seed=7)
    mixed = greedy_ids(llm, others + [target], [SamplingParams(temperature=1.0, max_tokens=15)] * 5 + [p])[5]
    assert alone == mixed
    other_seed = greedy_ids(llm, [target], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=15, seed=99,
                                                          ignore_eos=True))[0]
    assert other_seed != alone


def test_stop_string_truncates_and_is_not_emitted(llm):
    ps = prompts(1, seed=8)
    full = llm.generate(ps, GREEDY, use_tqdm=False)[0].outputs[0]
    text = full.text
    assert len(text) > 12
    stop = text[6:10]  # a substring that likely spans token boundaries
    first = text.find(stop)
    out = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert_all_blocks_free(llm)


def test_stop_token_ids_and_max_tokens(llm):
    ps = prompts(1, seed=9)
    ids = greedy_ids(llm, ps)[0]
    out = llm.generate(ps, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                          stop_token_ids=[ids[3]]), use_tqdm=False)[0].outputs[0]
    k = ids.index(ids[3])
    assert out.token_ids == ids[:k + 1] and out.finish_reason == "stop" and out.stop_reason == ids[3]


def _texts_by_tokens(llm, ids):
    """The text after each number of tokens (index k: the first k), as the tokenizer decodes them."""
    tok = llm.get_tokenizer()
    return [tok.decode(ids[:k]) for k in range(len(ids) + 1)]


def test_a_stop_string_on_the_last_allowed_token_is_a_stop(llm):
    ps = prompts(1, seed=9)
    ids = greedy_ids(llm, ps)[0]
    texts = _texts_by_tokens(llm, ids)
    # a token whose text brings a character that the text before it lacks: the stop string there
    k, c = next((k, c) for k in range(2, len(ids) + 1) for c in texts[k][len(texts[k - 1]):]
                if not c.isspace() and c != "\ufffd" and c not in texts[k - 1])
    out = llm.generate(ps, SamplingParams(temperature=0, max_tokens=k, ignore_eos=True, stop=[c]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == texts[k][:texts[k].index(c)]
    assert (out.finish_reason, out.stop_reason) == ("stop", c)  # was "length": max_tokens ended it too
    assert_all_blocks_free(llm)


def test_the_stop_token_text_is_left_out_unless_asked_for(llm):
    ps = prompts(1, seed=9)
    ids = greedy_ids(llm, ps)[0]
    texts = _texts_by_tokens(llm, ids)
    # the first token that is new to the output and whose text is whole characters
    k = next(k for k in range(1, len(ids))
             if ids[k] not in ids[:k] and "\ufffd" not in texts[k + 1][len(texts[k]) - 1:])
    for include in (False, True):
        out = llm.generate(ps, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[ids[k]],
                                              include_stop_str_in_output=include), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ids[:k + 1]  # the token id stays, its text only with include_stop_str_in_output
        assert out.text == texts[k + 1 if include else k]


def test_stop_strings_wait_for_min_tokens(llm):
    ps = prompts(1, seed=8)
    ids = greedy_ids(llm, ps)[0]
    texts = _texts_by_tokens(llm, ids)
    text = texts[-1]
    # a character that first appears within the first m tokens' text and again after it
    m, c = next((m, c) for m in range(1, len(ids)) for c in sorted(set(texts[m])) if not c.isspace() and c != "\ufffd"
                and text.find(c, len(texts[m])) != -1)
    later = text.find(c, len(texts[m]))
    out = llm.generate(ps, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[c], min_tokens=m),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:later] and (out.finish_reason, out.stop_reason) == ("stop", c)
    assert len(out.token_ids) > m
    early = llm.generate(ps, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[c]),
                         use_tqdm=False)[0].outputs[0]
    assert early.text == text[:text.index(c)] and len(early.token_ids) <= m  # without min_tokens: the first one
    assert_all_blocks_free(llm)


def test_finish_reasons_are_counted_per_sample(llm):
    """An n > 1 request's samples are counted by their own finish reasons (request_success_total), as vLLM
    does; it was once per request, by the first sample's reason."""
    ps = prompts(2, seed=11)
    free = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    first = llm.generate(ps, free, use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, stop_token_ids=[first[2]])
    before = dict(llm.engine.stats.finished)
    outs = llm.generate(ps, params, use_tqdm=False)
    reasons = collections.Counter(c.finish_reason for o in outs for c in o.outputs)
    assert reasons["stop"] >= 1 and sum(reasons.values()) == 6
    assert {k: v - before.get(k, 0) for k, v in llm.engine.stats.finished.items() if v != before.get(k, 0)} == \
        dict(reasons)


def test_prompt_tokens_count_once_prefilled(make_llm):
    """prompt_tokens ("prefill tokens processed") counts a prompt once its prefill produced an output, not at
    admission: a request aborted while it waited adds nothing."""
    llm = make_llm(max_num_seqs=1)
    engine = llm.engine
    first, second = prompts(2, seed=12)
    engine.add_request("first", first, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("second", second, SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.stats.prompt_tokens == 0
    engine.step()  # max_num_seqs 1: the first is prefilled, the second waits
    assert engine.stats.prompt_tokens == len(first)
    engine.abort_request("second")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats.prompt_tokens == len(first)
    assert_all_blocks_free(llm)


def test_the_sampled_token_has_its_rank_outside_the_top_n(llm):
    """A sampled token outside the top-N logprobs carries its rank among all of them (vLLM's; it was None)."""
    ps = prompts(2, seed=13)
    outs = llm.generate(ps, SamplingParams(temperature=2.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=2),
                        use_tqdm=False)
    ranks = []
    for c in (o.outputs[0] for o in outs):
        for tid, entry in zip(c.token_ids, c.logprobs, strict=True):
            above = sum(1 for t, e in entry.items() if t != tid and e.logprob > entry[tid].logprob)
            assert entry[tid].rank >= 1 and above == min(entry[tid].rank - 1, 2)
            ranks.append(entry[tid].rank)
    assert max(ranks) > 2  # some sampled tokens lie outside the top 2
    greedy = llm.generate(ps, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0),
                          use_tqdm=False)
    assert all(e[t].rank == 1 for o in greedy
               for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True))


def test_n_greedy_samples_are_one_sequence_reported_n_times(llm):
    """Greedy samples are one sample: computed once, reported n times (they were n sequences, whose first tokens
    could part under --dtype auto: a sibling recomputes the last prompt token in a step of another size)."""
    engine, ps = llm.engine, prompts(2, seed=14)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    engine.add_request("g", ps[0], params)
    assert len(engine.requests["g"].seqs) == 1 and len(engine.scheduler.waiting) == 1
    tokens, finished = engine.stats.generation_tokens, dict(engine.stats.finished)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    (out,) = outs
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == out.outputs[0].token_ids and c.text == out.outputs[0].text for c in out.outputs)
    assert engine.stats.generation_tokens - tokens == 3 * 6  # as many as the outputs hold
    assert engine.stats.finished["length"] - finished.get("length", 0) == 3
    assert out.outputs[0].token_ids == greedy_ids(llm, ps[:1], SamplingParams(temperature=0.0, max_tokens=6,
                                                                               ignore_eos=True))[0]
    sampled = llm.generate(ps[:1], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6), use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1  # sampled ones stay n sequences
    assert_all_blocks_free(llm)


def test_n_greedy_samples_fit_any_max_num_seqs(make_llm):
    # one sequence whatever n: not refused where n sampled sequences (which run at once) would be
    small = make_llm(max_num_seqs=2)
    ps = prompts(1, seed=15)
    (out,) = small.generate(ps, SamplingParams(n=5, temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs) == 5 and len({tuple(c.token_ids) for c in out.outputs}) == 1
    with pytest.raises(ValueError, match=r"n must be <= max_num_seqs \(2\)"):
        small.generate(ps, SamplingParams(n=3, temperature=1.0, max_tokens=5), use_tqdm=False)
    assert_all_blocks_free(small)


def test_n_parallel_samples_and_per_prompt_params(llm):
    out = llm.generate(prompts(1, seed=10), SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert_all_blocks_free(llm)


def test_prompt_over_max_model_len_is_rejected_with_both_numbers(make_llm):
    llm = make_llm(max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt has 100 tokens, but max_model_len is 64"):
        llm.generate([[5] * 100], GREEDY, use_tqdm=False)
    assert_all_blocks_free(llm)


def test_prompt_over_kv_capacity_is_rejected(make_llm):
    llm = make_llm(kv_cache_memory=4 * 16 * 2 * 2 * 2 * 16 * 4, block_size=16)  # 4 blocks = 64 tokens
    with pytest.raises(ValueError, match=r"prompt has 80 tokens.*max_model_len is 64.*KV cache holds 64"):
        llm.generate([[5] * 80], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("kw,field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-5), "top_k"),
    (dict(min_p=2), "min_p"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=1e7), "repetition_penalty"),
    (dict(repetition_penalty=1e-7), "repetition_penalty"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(logprobs=100), "logprobs"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_invalid_sampling_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**kw)


def test_bad_prompts_and_options(llm, make_llm):
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 2, 10**6]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="at least one token"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="unknown engine option"):
        make_llm(max_num_seq=3)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        make_llm(kv_cache_memory="12 parsecs")
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM("/nonexistent/model")
    assert_all_blocks_free(llm)


def test_kv_cache_memory_accepts_strings_and_ints(make_llm):
    a = make_llm(kv_cache_memory="1MiB", block_size=16)
    b = make_llm(kv_cache_memory=2**20, block_size=16)
    # bytes per block = 2 (K,V) * 2 layers * 2 kv heads * 16 head_dim * 16 tokens * 4 bytes
    assert a.engine.kv_cache.num_blocks == b.engine.kv_cache.num_blocks == 2**20 // (2 * 2 * 2 * 16 * 16 * 4)


def test_batched_and_reference_attention_backends_agree(make_llm):
    ps = prompts(12, seed=11, lo=5, hi=150)
    ref = greedy_ids(make_llm(attention_backend="reference", max_num_batched_tokens=64), ps)
    assert greedy_ids(make_llm(attention_backend="batched", max_num_batched_tokens=64), ps) == ref
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        make_llm(attention_backend="flash-magic")


def test_bfloat16_stays_close_to_float32(make_llm):
    """bf16 weights and KV: first-token logprobs within 0.1 of fp32, and where fp32's top-1 leads the
    runner-up by more than 0.5 nats it stays top-1 (closer near-ties may flip)."""
    ps = prompts(8, seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2)
    f32 = make_llm().generate(ps, params, use_tqdm=False)
    bf16 = make_llm(dtype="bfloat16").generate(ps, params, use_tqdm=False)
    assert bf16[0].outputs[0].logprobs is not None
    checked = 0
    for a, b in zip(f32, bf16, strict=True):
        top_a = sorted(a.outputs[0].logprobs[0].items(), key=lambda kv: -kv[1].logprob)
        lp_b = b.outputs[0].logprobs[0]
        tok = top_a[0][0]
        if tok in lp_b:
            assert abs(lp_b[tok].logprob - top_a[0][1].logprob) < 0.1
        if top_a[0][1].logprob - top_a[1][1].logprob > 0.5:
            assert b.outputs[0].token_ids[0] == tok
            checked += 1
    assert checked > 0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_kv_cache_memory_is_resident_only_once_written():
    """The CPU KV cache reads as zeros but costs resident memory only for the blocks written: a 512 MiB
    cache adds little RSS until it is filled (the fill proves the measurement can see it)."""
    import torch

    from pagellm.platforms.cpu_memory import zeros_on_touch

    before = _rss_bytes()
    cache = zeros_on_touch((2, 2048, 16, 8, 256), torch.float32)  # 512 MiB
    assert cache.shape == (2, 2048, 16, 8, 256) and cache.dtype == torch.float32
    assert cache[:, ::97].abs().sum().item() == 0  # reads as zeros
    assert _rss_bytes() - before < 128 * 2**20
    cache[0, 5] = 1.0  # one block written: still small
    assert _rss_bytes() - before < 128 * 2**20
    cache.fill_(2.0)
    assert _rss_bytes() - before > 400 * 2**20


def _resident_bytes(t) -> int:
    """Bytes of tensor t's pages that are resident (mincore: the range's own pages, whatever mapping
    the kernel merged them into)."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    lo = t.data_ptr() // page * page
    n = (t.data_ptr() + t.numel() * t.element_size() - lo + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(lo, n * page, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec) * page


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux")
def test_populate_makes_memory_resident_and_keeps_its_contents():
    """populate faults every page in now (madvise MADV_POPULATE_WRITE, or one byte per page written back
    where that is refused) and changes no value: a fresh cache still reads as zeros, written data stays."""
    import torch

    from pagellm.platforms.cpu_memory import populate, zeros_on_touch

    cache = zeros_on_touch((2, 512, 16, 8, 64), torch.float16)  # 16 MiB
    assert _resident_bytes(cache) < 4 * 2**20
    cache[1, 7] = 3.0
    populate([cache, cache[0]], threads=2)
    assert _resident_bytes(cache) >= 16 * 2**20
    assert cache[0].abs().sum().item() == 0 and cache[1, 7].eq(3.0).all() and cache[1, 8].abs().sum() == 0
    heap = torch.arange(3 * 4096 + 5, dtype=torch.float32)[5:]  # starts inside a page: the fallback path
    populate([heap], threads=1)
    assert heap.equal(torch.arange(5, 3 * 4096 + 5, dtype=torch.float32))


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux")
def test_engine_kv_cache_resident_from_start_with_prefault(make_llm):
    """--prefault-kv-cache makes the CPU KV cache resident at start (no page faults inside steps); by
    default it becomes resident block by block, and both give the same tokens."""
    eager, lazy = make_llm(kv_cache_memory="32MiB", prefault_kv_cache=True), make_llm(kv_cache_memory="32MiB")
    eager_cache, lazy_cache = eager.engine.runner.kv_caches[0], lazy.engine.runner.kv_caches[0]
    nbytes = eager_cache.numel() * eager_cache.element_size()
    assert _resident_bytes(eager_cache) >= nbytes
    assert _resident_bytes(lazy_cache) < nbytes // 2
    ps = prompts(3, seed=4)
    assert greedy_ids(eager, ps) == greedy_ids(lazy, ps)


def test_kv_cache_that_does_not_fit_in_memory_is_refused_at_start(make_llm, monkeypatch):
    """A cache made resident at start has to fit in the memory available now: one clear error naming the
    way out, not swapping or the OOM killer; without --prefault-kv-cache it still starts."""
    from pagellm.platforms import cpu

    monkeypatch.setattr(cpu, "available_memory", lambda: 34 * 2**20)  # 32 MiB > 90% of it
    with pytest.raises(ValueError, match=r"KV cache \(32 MiB\) does not fit in the 34 MiB.*--prefault-kv-cache"):
        make_llm(kv_cache_memory="32MiB", prefault_kv_cache=True)
    assert greedy_ids(make_llm(kv_cache_memory="32MiB"), prompts(1)) != []
