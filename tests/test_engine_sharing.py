"""KV sharing through the whole engine: prefix caching, copy-on-write forks, swap preemption."""

import random

import pytest

from pagellm import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def make_llm(tiny_hf_model, smollm_gguf_path):
    path = tiny_hf_model("llama", max_position_embeddings=1024)

    def make(**kw):
        kw.setdefault("kv_cache_memory", "8MiB")
        return LLM(path, tokenizer=smollm_gguf_path, block_size=8, **kw)

    return make


def shared_prefix_prompts(n, prefix_len=70, seed=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, 512) for _ in range(rng.randint(1, 20))] for _ in range(n)]


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_idle(llm):
    kv = llm.engine.kv_cache
    assert kv.pool.num_free == kv.num_blocks and not kv.req_blocks and not kv.req_host_blocks


def test_prefix_caching_on_and_off_give_identical_greedy_output(make_llm):
    ps = shared_prefix_prompts(10)
    cached = make_llm()
    first = ids(cached.generate(ps[:1], PARAMS, use_tqdm=False))
    rest = ids(cached.generate(ps[1:], PARAMS, use_tqdm=False))  # these hit the first prompt's blocks
    assert cached.engine.kv_cache.prefix_hits >= 9 * 64
    plain = make_llm(enable_prefix_caching=False)
    assert first + rest == ids(plain.generate(ps, PARAMS, use_tqdm=False))
    assert plain.engine.kv_cache.prefix_hits == 0
    assert_idle(cached)


def test_n_children_equal_n_1_runs_with_their_seeds_and_share_the_prompt(make_llm):
    """n seeded samples fork from the first's prompt blocks (copy-on-write of the partial last block); sample i
    equals an n = 1 run with seed + i. Greedy samples are one sequence reported n times (no fork)."""
    llm = make_llm(enable_prefix_caching=False)
    prompt = shared_prefix_prompts(1, prefix_len=45)[0]  # 45 tokens: the fork shares a partial block
    sampled = dict(temperature=1.0, max_tokens=30, ignore_eos=True)
    singles = [ids(llm.generate([prompt], SamplingParams(seed=5 + i, **sampled), use_tqdm=False))[0]
               for i in range(4)]
    out = llm.generate([prompt], SamplingParams(n=4, seed=5, **sampled), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == singles and len({tuple(t) for t in singles}) > 1
    assert llm.engine.kv_cache.num_cow_copies >= 3
    single = ids(llm.generate([prompt], PARAMS, use_tqdm=False))[0]
    out = llm.generate([prompt], SamplingParams(n=4, temperature=0.0, max_tokens=30, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [single] * 4
    assert_idle(llm)


def test_swap_and_recompute_preemption_match_an_unpreempted_run(make_llm):
    ps = shared_prefix_prompts(10, prefix_len=10, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    expected = ids(make_llm().generate(ps, params, use_tqdm=False))
    block_bytes = 2 * 2 * 2 * 16 * 8 * 4  # K+V, 2 layers, 2 kv heads, head_dim 16, block 8, fp32
    for mode in ("swap", "recompute"):
        llm = make_llm(kv_cache_memory=30 * block_bytes, preemption_mode=mode, swap_space="1MiB")
        assert ids(llm.generate(ps, params, use_tqdm=False)) == expected, mode
        stats = llm.engine.scheduler.stats
        assert stats.num_preemptions > 0
        assert (stats.num_swapped_out > 0) == (mode == "swap")
        assert stats.num_swapped_in == stats.num_swapped_out and stats.num_swap_recomputes == 0
        assert_idle(llm)


def test_a_swap_space_too_small_for_the_victim_recomputes_and_says_so(make_llm, caplog):
    ps = shared_prefix_prompts(10, prefix_len=10, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    expected = ids(make_llm().generate(ps, params, use_tqdm=False))
    block_bytes = 2 * 2 * 2 * 16 * 8 * 4
    llm = make_llm(kv_cache_memory=30 * block_bytes, preemption_mode="swap", swap_space=block_bytes)
    with caplog.at_level("WARNING", logger="pagellm"):
        assert ids(llm.generate(ps, params, use_tqdm=False)) == expected
    stats = llm.engine.scheduler.stats
    assert stats.num_swap_recomputes > 0 and stats.num_preemptions == stats.num_swapped_out + stats.num_swap_recomputes
    warned = [r.getMessage() for r in caplog.records if "is recomputed instead (raise --swap-space" in r.getMessage()]
    assert len(warned) == 1, warned  # once per engine, not once per preemption
    assert_idle(llm)


def test_cache_salt_separates_tenants(make_llm):
    llm = make_llm()
    p = shared_prefix_prompts(1)[0]
    eng = llm.engine
    for rid, salt in (("a", "t1"), ("b", "t2"), ("c", "t1")):
        before = eng.kv_cache.prefix_hits
        eng.add_request(rid, p, SamplingParams(max_tokens=1), cache_salt=salt)
        while eng.has_unfinished_requests():
            eng.step()
        hit = eng.kv_cache.prefix_hits - before
        assert hit == (0 if rid != "c" else 64), rid
