"""Speculative decoding: n-gram and draft-model proposers are lossless in the continuous-batching engine."""

import random

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.sample.rejection import verify
from pagellm.spec_decode.ngram import propose_ngram

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def test_ngram_prefers_the_longest_and_most_recent_match():
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert propose_ngram(toks, 3, 1, 3) == [7, 8, 5]  # "2 3" last seen before 7 8 5
    assert propose_ngram(toks + [7], 2, 3, 3) == [8, 5]  # "2 3 7" occurred once
    assert propose_ngram([1, 2, 3, 4], 3, 1, 2) == []  # no repeat
    assert propose_ngram([5, 5], 4, 1, 2) == [5]  # proposals stop at the end of the sequence


def test_rejection_sampler_keeps_the_target_distribution():
    # Exact check of the acceptance rule on one position: P(out = t) must equal p(t) for any q.
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.1, 0.2, 0.6])
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(4)
    n = 20000
    for _ in range(n):
        draft = int(torch.multinomial(q, 1, generator=gen))
        out = verify(torch.stack([p, p]), [draft], q[None], gen)
        counts[out[0]] += 1
    assert torch.allclose(counts / n, p, atol=0.015)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_verification_draws_one_uniform_per_token_returned(proposer):
    # A seeded request's generator must end where plain decoding of the same tokens leaves it, whatever the number
    # of drafts: else its later tokens depend on how many drafts the controller, the budget or a preemption allowed.
    g = torch.Generator().manual_seed(3)
    for trial in range(200):
        p = torch.rand(5, 7, generator=g) ** 4
        p /= p.sum(-1, keepdim=True)
        q = torch.rand(4, 7, generator=g) + 0.1
        q /= q.sum(-1, keepdim=True)
        k = trial % 4 + 1
        draft = [int(torch.multinomial(q[i] if proposer == "draft" else p[i], 1, generator=g)) for i in range(k)]
        gen = torch.Generator().manual_seed(trial)
        out = verify(p[:k + 1], draft, q[:k] if proposer == "draft" else None, gen)
        plain = torch.Generator().manual_seed(trial)
        for _ in out:
            torch.rand(1, dtype=torch.float64, generator=plain)
        assert 1 <= len(out) <= k + 1 and out[:-1] == draft[:len(out) - 1]
        assert torch.equal(gen.get_state(), plain.get_state()), (trial, k, out)


def test_ngram_verification_gives_plain_decodings_tokens():
    # With a point-mass proposer each position's token is the plain draw with that position's uniform.
    p = torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3], [0.3, 0.3, 0.4]])
    for seed in range(50):
        gen = torch.Generator().manual_seed(seed)
        out = verify(p, [1, 0], None, gen)
        plain = torch.Generator().manual_seed(seed)
        expect = []
        for row in p:
            u = float(torch.rand(1, dtype=torch.float64, generator=plain))
            expect.append(int(torch.searchsorted(row.double().cumsum(0), u, right=True)))
            if len(expect) > 2 or expect[-1] != [1, 0, None][len(expect) - 1]:
                break
        assert out == expect, seed


@pytest.fixture(scope="module")
def tiny(tiny_hf_model):
    return tiny_hf_model("llama", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def draft_dir(tiny_hf_model):
    # A deliberately different model with the same vocabulary: most of its proposals are rejected.
    return tiny_hf_model("llama", num_hidden_layers=1, initializer_range=0.05, hidden_size=32,
                         intermediate_size=64)


def make(tiny, tok, **kw):
    """These tests check verification itself, so every draft found is verified (adaptive drafting, which
    may drop drafts that do not pay, is tested in tests/test_spec_adaptive.py)."""
    kw.setdefault("kv_cache_memory", "8MiB")
    kw.setdefault("speculative_adaptive", False)
    return LLM(tiny, tokenizer=tok, block_size=8, **kw)


def repetitive_prompts(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, 512) for _ in range(rng.randint(3, 8))]
        out.append((motif * 8)[:rng.randint(20, 60)])
    return out


def ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_identity_in_mixed_batches_with_preemption(tiny, draft_dir, smollm_gguf_path, method):
    ps = repetitive_prompts(10) + [[random.Random(i).randrange(3, 512) for _ in range(90)] for i in range(4)]
    params = [GREEDY] * 12 + [SamplingParams(n=2, temperature=0, max_tokens=25, ignore_eos=True)] * 2  # one seq each
    expected = ids(make(tiny, smollm_gguf_path).generate(ps, params, use_tqdm=False))
    extra = {"draft_model": draft_dir} if method == "draft" else {}
    # A budget of 40 blocks of 8 tokens makes the batch preempt; a small step budget mixes prefill chunks.
    llm = make(tiny, smollm_gguf_path, speculative_method=method, num_speculative_tokens=5,
               kv_cache_memory=40 * 2 * 2 * 2 * 16 * 8 * 4, max_num_batched_tokens=96, **extra)
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected
    st = llm.engine.scheduler.stats
    assert st.num_draft_tokens > 0 and st.num_preemptions > 0
    if method == "ngram":
        assert st.num_accepted_tokens > 0
    kv = llm.engine.kv_cache
    assert kv.pool.num_free == kv.num_blocks


def test_seeded_sampling_with_ngram_drafts_repeats_plain_decoding(tiny, smollm_gguf_path):
    # One uniform per token, and n-gram verification is the plain draw: a seeded request gives the tokens it gives
    # without speculation, however many drafts the budget, a preemption or the adaptive controller let through.
    ps = repetitive_prompts(6, seed=1)
    params = [SamplingParams(temperature=0.3, top_p=0.9, seed=100 + i, max_tokens=30, ignore_eos=True)
              for i in range(6)]
    expected = ids(make(tiny, smollm_gguf_path).generate(ps, params, use_tqdm=False))
    for kw in ({}, {"max_num_batched_tokens": 7}, {"kv_cache_memory": 40 * 2 * 2 * 2 * 16 * 8 * 4},
               {"speculative_adaptive": True}):
        llm = make(tiny, smollm_gguf_path, speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, **kw)
        assert ids(llm.generate(ps, params, use_tqdm=False)) == expected, kw
        st = llm.engine.scheduler.stats
        assert st.num_accepted_tokens > 0 or kw.get("speculative_adaptive"), kw
        if "kv_cache_memory" in kw:
            assert st.num_preemptions > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_disable_by_batch_size_skips_drafts_only_in_big_steps(tiny, draft_dir, smollm_gguf_path, method):
    """With 6 requests and the limit at 4, steps verify drafts only once fewer than 4 are running (the
    shorter requests finish first); output stays identical; a bad limit is refused."""
    ps = repetitive_prompts(6, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (8, 10, 12, 40, 45, 50)]
    expected = ids(make(tiny, smollm_gguf_path).generate(ps, params, use_tqdm=False))
    extra = {"draft_model": draft_dir} if method == "draft" else {}
    llm = make(tiny, smollm_gguf_path, speculative_method=method, speculative_disable_by_batch_size=4, **extra)
    eng, drafted_at = llm.engine, []
    propose = eng.proposer.propose

    def spy(running):
        drafted_at.append(len(running))
        propose(running)

    eng.proposer.propose = spy
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected
    assert drafted_at and max(drafted_at) < 4
    assert eng.scheduler.stats.num_draft_tokens > 0
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size"):
        make(tiny, smollm_gguf_path, speculative_method=method, speculative_disable_by_batch_size=0, **extra)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_identity_against_transformers(tiny, draft_dir, smollm_gguf_path, method):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    ps = repetitive_prompts(3, seed=5)
    extra = {"draft_model": draft_dir} if method == "draft" else {}
    llm = make(tiny, smollm_gguf_path, speculative_method=method, num_speculative_tokens=4, **extra)
    ours = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    for p, o in zip(ps, ours, strict=True):
        ref = model.generate(torch.tensor([p]), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                             pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
        assert o == ref


def test_edge_cases_max_tokens_mid_run_stop_string_and_k_beyond_budget(tiny, smollm_gguf_path):
    plain = make(tiny, smollm_gguf_path)
    spec = make(tiny, smollm_gguf_path, speculative_method="ngram", num_speculative_tokens=8)
    p = repetitive_prompts(1, seed=7)
    for max_tokens in (1, 2, 3, 7):  # K=8 exceeds what is left: the run is cut at max_tokens exactly
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        a = plain.generate(p, params, use_tqdm=False)[0].outputs[0]
        b = spec.generate(p, params, use_tqdm=False)[0].outputs[0]
        assert b.token_ids == a.token_ids and len(b.token_ids) == max_tokens and b.finish_reason == "length"
    text = plain.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text[10:14]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    a = plain.generate(p, params, use_tqdm=False)[0].outputs[0]
    b = spec.generate(p, params, use_tqdm=False)[0].outputs[0]
    assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, "stop")


@pytest.mark.parametrize("budget,n", [(2, 1), (8, 3)])
def test_a_draft_model_whose_cut_drafts_all_pass_and_its_kv_goes_back(tiny, smollm_gguf_path, budget, n):
    """The target as its own draft (every draft accepted) under a step budget that cuts the drafts verified:
    the draft has then computed the target's next token already, and its next proposal ran a forward of no
    tokens, failing the whole step. Greedy output equals plain decoding; the draft's KV blocks come back as
    requests finish (they had stayed held until the next proposal) and on abort."""
    ps = [[random.Random(i).randrange(3, 512) for _ in range(3)] for i in range(n)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = ids(make(tiny, smollm_gguf_path).generate(ps, params, use_tqdm=False))
    llm = make(tiny, smollm_gguf_path, speculative_method="draft", draft_model=tiny, num_speculative_tokens=4,
               max_num_batched_tokens=budget)
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected
    st, draft = llm.engine.scheduler.stats, llm.engine.proposer
    assert st.num_accepted_tokens > 0
    assert draft.kv.pool.num_free == draft.kv.num_blocks and not draft.seqs
    engine = llm.engine
    engine.add_request("a", ps[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert draft.seqs
    engine.abort_request("a")
    assert draft.kv.pool.num_free == draft.kv.num_blocks and not draft.seqs


def test_a_draft_cache_too_small_for_one_block_names_its_flag(tiny, smollm_gguf_path):
    with pytest.raises(ValueError, match=r"^draft_kv_cache_memory \(1KiB\) holds no KV block of the draft model"):
        make(tiny, smollm_gguf_path, speculative_method="draft", draft_model=tiny, draft_kv_cache_memory="1KiB")


def test_a_proposal_containing_a_stop_token_finishes_the_request(tiny, smollm_gguf_path):
    plain = make(tiny, smollm_gguf_path)
    # The target itself as draft model: every draft is accepted, so the stop id arrives inside an
    # accepted run, and what was drafted after it must be dropped.
    spec = make(tiny, smollm_gguf_path, speculative_method="draft", draft_model=tiny, num_speculative_tokens=6)
    for seed in range(20):
        p = repetitive_prompts(1, seed=seed)[0]
        greedy = plain.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        if greedy[4] not in greedy[:4]:
            break
    params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[greedy[4]])
    a = plain.generate([p], params, use_tqdm=False)[0].outputs[0]
    b = spec.generate([p], params, use_tqdm=False)[0].outputs[0]
    assert b.token_ids == a.token_ids == greedy[:5] and b.finish_reason == "stop"
    st = spec.engine.scheduler.stats
    assert st.num_accepted_tokens == st.num_draft_tokens == 6  # all verified; the 2 after the stop dropped
    # a stop string that ends before that stop id in the same accepted run: the string ended the output, and
    # stop_reason says so as in plain decoding (it was the id: the scheduler had finished the run there first)
    tok = plain.get_tokenizer()

    def stop_at_fourth(p, greedy):  # a stop string (and its plain output) ending the output at token 4
        text = tok.decode(greedy[:4])
        for stop in (text[-n:] for n in (2, 3, 4) if text[-n:].strip() and "\ufffd" not in text):
            params = SamplingParams(temperature=0, max_tokens=40, stop=[stop], stop_token_ids=[greedy[4]])
            a = plain.generate([p], params, use_tqdm=False)[0].outputs[0]
            if a.stop_reason == stop and len(a.token_ids) == 4:
                return stop, params, a
        return None

    for seed in range(60):
        p = repetitive_prompts(1, seed=seed)[0]
        greedy = plain.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        found = greedy[4] not in greedy[:4] and stop_at_fourth(p, greedy)
        if found:
            break
    else:
        pytest.fail("no prompt whose output a stop string ends at its fourth token")
    stop, params, a = found
    b = spec.generate([p], params, use_tqdm=False)[0].outputs[0]
    assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == (a.text, a.token_ids, "stop", stop)


def _chi_square_two_sample(a: list[int], b: list[int]) -> tuple[float, int]:
    cats = sorted(set(a) | set(b))
    ca = torch.tensor([a.count(c) for c in cats], dtype=torch.float64)
    cb = torch.tensor([b.count(c) for c in cats], dtype=torch.float64)
    keep = (ca + cb) >= 10  # pool rare categories so the statistic's approximation holds
    ca = torch.cat([ca[keep], ca[~keep].sum(0, keepdim=True)])
    cb = torch.cat([cb[keep], cb[~keep].sum(0, keepdim=True)])
    na, nb = ca.sum(), cb.sum()
    stat = (((ca * (nb / na).sqrt() - cb * (na / nb).sqrt()) ** 2) / (ca + cb).clamp_min(1)).sum()
    return float(stat), int((ca + cb > 0).sum()) - 1


# chi-square critical values at significance 0.001, by degrees of freedom
_CRIT_001 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26, 32.91, 34.53, 36.12,
             37.70, 39.25, 40.79, 42.31, 43.82, 45.31, 46.80, 48.27, 49.73, 51.18, 52.62, 54.05, 55.48, 56.89]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampling_distribution_is_unchanged(tiny_hf_model, smollm_gguf_path, method):
    """Tokens 2-4 (the speculated ones) have the same distribution with and without speculation:
    a two-sample chi-square test per position at significance 0.001, 1500 samples each."""
    model = tiny_hf_model("llama", vocab_size=24, initializer_range=0.15)
    draft = tiny_hf_model("llama", vocab_size=24, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                          initializer_range=0.3)
    prompt = list(range(24)) + [5, 9, 13, 5, 9]  # every token occurs in the context: n-gram always proposes
    n = 1500
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=4, ignore_eos=True, seed=i) for i in range(n)]

    def samples(**kw):
        llm = LLM(model, tokenizer=smollm_gguf_path, block_size=8, kv_cache_memory="16MiB", max_num_seqs=256,
                  max_num_batched_tokens=4096, **kw)
        outs = llm.generate([prompt] * n, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine.scheduler.stats

    base, _ = samples()
    extra = {"draft_model": draft} if method == "draft" else {}
    # every draft verified (adaptive drafting would drop most: they are rarely accepted here)
    spec, stats = samples(speculative_method=method, num_speculative_tokens=3, ngram_min=1, speculative_adaptive=False,
                          **extra)
    assert stats.num_draft_tokens >= n and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for pos in (1, 2, 3):
        stat, df = _chi_square_two_sample([s[pos] for s in base], [s[pos] for s in spec])
        assert stat < _CRIT_001[df - 1], f"position {pos}: chi2={stat:.1f} with {df} df"


def test_smollm2_greedy_identity_with_both_proposers(smollm_gguf_path, tmp_path):
    from pagellm.bench.common import GROUNDED_PROMPT
    from scripts.make_draft_model import make_draft

    draft = make_draft(smollm_gguf_path, 2, str(tmp_path / "draft"))
    msgs = [{"role": "user", "content": GROUNDED_PROMPT}]
    params = SamplingParams(temperature=0, max_tokens=48)
    base = LLM(kv_cache_memory="64MiB").chat(msgs, params, use_tqdm=False)[0].outputs[0].token_ids
    for kw in (dict(speculative_method="ngram"), dict(speculative_method="draft", draft_model=draft)):
        llm = LLM(kv_cache_memory="64MiB", num_speculative_tokens=5, **kw)
        assert llm.chat(msgs, params, use_tqdm=False)[0].outputs[0].token_ids == base, kw
        assert llm.engine.scheduler.stats.num_draft_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("batch", [8, 16])
def test_speculation_is_lossless_where_prompt_chunks_share_steps_with_decode_rows(smollm_gguf_path, batch):
    """Where prompt rows run on one-plane int8 (OpChoices.int8_many_rows) and decode rows on the decode paths, a
    step mixing both forwards its decode rows apart (ModelRunner._decode_apart), on the path their batch's size
    picks (ModelRunner._batch_rows), so which prompt chunks share a token's step, and how many of the batch's
    rows decode in it, which differ between plain and speculative runs, never change it (with the decode rows in
    the prompt forward, 3 of 16 sequences parted in a probe's run of this kind; with them on the many-row path
    whatever the batch, 2 of 8). `batch` prompts of 300-700 tokens of English text, all at once."""
    from pagellm.bench.workload import text_prompts
    from pagellm.platforms import get_platform

    if not get_platform("cpu").op_choices(torch.float32, auto=True).int8_many_rows:
        pytest.skip("prompt rows are not one-plane int8 here (AVX-512 BF16 and VNNI without AMX)")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    opts = dict(dtype="auto", enable_prefix_caching=False, kv_cache_memory="512MiB")
    plain = LLM(**opts)
    prompts = [{"prompt_token_ids": p} for p in text_prompts(plain.get_tokenizer(), batch, (300, 700), seed=3)]
    base = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(**opts, speculative_method="ngram", num_speculative_tokens=4, speculative_adaptive=False)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == base
    assert spec.engine.scheduler.stats.num_accepted_tokens > 0


def test_dtype_auto_speculation_is_lossless_at_small_batches(smollm_gguf_path):
    """Under --dtype auto on a bf16 CPU a plain step of 4 rows runs the few-row float32 kernels and a step of
    more rows the bf16 GEMMs: a verification step (4 requests x 5 rows) must compute as the plain step would
    (linear_method.path_rows), or outputs part from plain decoding (they did at batch 4 on the Zen 5 VM:
    `pagellm bench latency --task grounded --batch-sizes 4 --dtype auto --speculative-method ngram`).
    Elsewhere auto is float32 and the path check is skipped."""
    from pagellm.bench.common import GROUNDED_PROMPT
    from pagellm.quant.linear_method import drafts_in_step

    plain = LLM(dtype="auto")
    proj = plain.engine.model.layers[0].mlp.gate_up_proj
    method = proj.quant_method
    if method.choices.bf16_gemm:
        limit = method.max_rows  # 6, or 12 with int8 activations (platforms/cpu.py)
        assert proj.bf16_rows(20)
        with drafts_in_step(16):  # 4 requests, 4 drafts each
            assert not proj.bf16_rows(20)
            assert proj.bf16_rows(16 + limit + 1)  # limit + 1 requests' rows: the plain step would be bf16 too
        if method.choices.int8_many_rows:  # prompt rows on one-plane int8 (prompt_step); decode rows never
            from pagellm.quant.linear_method import prompt_step

            assert not method.int8_rows(proj, 1000) and proj.bf16_rows(1000)
            with prompt_step(True):
                assert method.int8_rows(proj, 5) and method.int8_rows(proj, 1000)
    msgs = [{"role": "user", "content": GROUNDED_PROMPT}]
    params = SamplingParams(temperature=0, max_tokens=200)
    base = [o.outputs[0].token_ids for o in plain.chat([msgs] * 4, params, use_tqdm=False)]
    spec = LLM(dtype="auto", speculative_method="ngram", num_speculative_tokens=4, speculative_adaptive=False)
    assert [o.outputs[0].token_ids for o in spec.chat([msgs] * 4, params, use_tqdm=False)] == base
    stats = spec.engine.scheduler.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
