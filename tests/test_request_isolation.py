"""A request whose own parameters make the step's sampling fail fails alone (pagellm/engine/isolation.py):
the others of its batch finish with exactly the tokens they get without it, and no KV block leaks."""

import random

import pytest
import torch

from pagellm import LLM, SamplingParams

# a tiny model: seconds per test; a minute means something hangs
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def make_llm(tiny_hf_model, smollm_gguf_path):
    path = tiny_hf_model("llama", max_position_embeddings=1024)

    def make(**kw):
        return LLM(path, tokenizer=smollm_gguf_path, kv_cache_memory="8MiB", **kw)

    return make


def _prompts(n, seed=0):
    rng = random.Random(seed)
    # repeated runs give the n-gram proposer drafts to verify
    return [[rng.randrange(3, 512) for _ in range(rng.randint(4, 12))] * 3 for _ in range(n)]


def _sixteen() -> list[tuple[list[int], SamplingParams]]:
    """Greedy, seeded random (with top-p, penalties, logit_bias) and n=2 requests: all reproducible."""
    ps = _prompts(16, seed=1)
    params = []
    for i in range(16):
        if i % 4 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        elif i % 4 == 1:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=12, ignore_eos=True))
        elif i % 4 == 2:
            params.append(SamplingParams(n=2, temperature=1.0, seed=7 * i, max_tokens=10, ignore_eos=True,
                                         frequency_penalty=0.5))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={5: 3.0}))
    return list(zip(ps, params, strict=True))


# Poisons set once the request is admitted (admission checks every field again, and refuses both):
SEED_POISON = {"seed": 2**64}  # torch.Generator.manual_seed raises in the step
BIAS_POISON = {"logit_bias": {5: "not a number"}}  # a logits-processing failure (float() raises in the sampler)


def _seeded() -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=1, max_tokens=8)


def _joins(make, fields):
    """The poison joins the running batch."""

    def join(eng):
        p = make()
        eng.add_request("poison", [5, 6, 7, 8, 9], p)
        for name, value in fields.items():
            setattr(p, name, value)

    return join


def _turns_bad(eng):
    """The poison ran well for a while (it arrived last: the others were verified before it in the
    failed call, and their seeded generators drew), then its logits processing fails."""
    eng.requests["poison"].seqs[0].request.params.logit_bias = {5: "not a number"}


def _run(llm, reqs, poison=None, poison_after_steps=1):
    """Add the 16, step a little, poison (a new request joins, or one running turns bad), run to the end."""
    eng = llm.engine
    for i, (prompt, p) in enumerate(reqs):
        eng.add_request(f"r{i}", prompt, p)
    if poison is _turns_bad:
        eng.add_request("poison", [5, 6, 7, 8] * 3, SamplingParams(temperature=0.0, max_tokens=20))
    finals = {}

    def step():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out

    for _ in range(poison_after_steps):
        step()
    if poison is not None:
        poison(eng)
    while eng.has_unfinished_requests():
        step()
    return finals


def _assert_all_blocks_free(llm):
    kv = llm.engine.kv_cache
    assert kv.pool.num_free == kv.num_blocks and not kv.req_blocks and kv.usage() == 0
    assert not llm.engine.scheduler.has_unfinished_requests() and not llm.engine.requests


@pytest.mark.parametrize("speculative", [None, "ngram"])
@pytest.mark.parametrize("poison,cause", [(_joins(_seeded, SEED_POISON), "Overflow"),
                                          (_joins(lambda: SamplingParams(temperature=0.0, max_tokens=8), BIAS_POISON),
                                           "could not convert"),
                                          (_turns_bad, "could not convert")], ids=["seed", "bias", "turns-bad"])
def test_a_poisoned_request_fails_alone_and_the_16_others_are_unchanged(make_llm, speculative, poison, cause):
    # adaptive drafting follows measured step times, and what is drafted changes seeded draws
    kw = dict(speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False) if speculative else {}
    llm = make_llm(**kw)
    reqs = _sixteen()
    clean = _run(llm, reqs)
    _assert_all_blocks_free(llm)
    finals = _run(llm, reqs, poison)
    _assert_all_blocks_free(llm)

    bad = finals.pop("poison")
    assert bad.finished and bad.error is not None and cause in bad.error, bad.error
    assert [c.finish_reason for c in bad.outputs] == ["error"]
    assert llm.engine.stats.finished.get("error") == 1
    assert sorted(finals) == sorted(clean)
    for rid, out in clean.items():
        assert finals[rid].error is None
        assert [c.token_ids for c in finals[rid].outputs] == [c.token_ids for c in out.outputs], rid
        assert [c.finish_reason for c in finals[rid].outputs] == [c.finish_reason for c in out.outputs]


def test_offline_generate_returns_the_error_and_the_rest(make_llm, poison_when_admitted):
    llm = make_llm()
    reqs = _sixteen()[:4]
    prompts = [p for p, _ in reqs] + [[5, 6, 7]]
    poisoned = _seeded()
    poison_when_admitted(llm.engine, poisoned, **SEED_POISON)
    outs = llm.generate(prompts, [p for _, p in reqs] + [poisoned], use_tqdm=False)
    assert [o.error is None for o in outs] == [True] * 4 + [False]
    assert outs[-1].outputs[0].finish_reason == "error" and "seed" not in outs[-1].outputs[0].text
    assert all(len(o.outputs[0].token_ids) > 0 for o in outs[:4])
    _assert_all_blocks_free(llm)


def test_a_poisoned_n_request_fails_whole_and_a_beam_search_beside_it_goes_on(make_llm):
    llm = make_llm()
    eng = llm.engine
    beam = SamplingParams(n=2, use_beam_search=True, max_tokens=6)
    ok = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    clean = llm.generate([[5, 6, 7], [11, 12, 13]], [beam, ok], use_tqdm=False)
    eng.add_request("beam", [5, 6, 7], beam)
    eng.add_request("n3", [8, 9, 10], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6))
    eng.add_request("ok", [11, 12, 13], ok)
    eng.requests["n3"].seqs[2].request.params.logit_bias = {5: "x"}  # one sequence: the request fails whole
    finals = {}
    while eng.has_unfinished_requests():
        finals.update({o.request_id: o for o in eng.step() if o.finished})
    assert finals["n3"].error is not None and [c.finish_reason for c in finals["n3"].outputs] == ["error"] * 3
    assert finals["beam"].error is None and finals["ok"].error is None
    assert [c.token_ids for c in finals["beam"].outputs] == [c.token_ids for c in clean[0].outputs]
    assert finals["ok"].outputs[0].token_ids == clean[1].outputs[0].token_ids
    _assert_all_blocks_free(llm)


def test_seed_out_of_range_is_refused_at_validation():
    for seed in (2**64, -2**63 - 1, 2.5, True):
        with pytest.raises(ValueError, match="seed must be an integer in"):
            SamplingParams(seed=seed)
    SamplingParams(seed=2**64 - 1)
    SamplingParams(seed=-2**63)
    with pytest.raises(ValueError, match="seed must be"):  # sample i of n is seeded seed + i
        SamplingParams(n=2, seed=2**64 - 1)


def test_request_ids_that_look_like_sequence_ids_do_not_collide(make_llm):
    """A client picks request ids (X-Request-Id): 'zz#1' and 'zz#beam0' beside 'zz' with n = 2 and a beam search
    on 'b' must stay apart (the engine names sequences after their request: 'zz#1' had been zz's second)."""
    llm = make_llm()
    eng = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    two = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    beam = SamplingParams(n=2, use_beam_search=True, max_tokens=6)
    alone = llm.generate([[5, 6, 7], [8, 9, 10], [11, 12, 13]], [greedy, two, beam], use_tqdm=False)
    eng.add_request("zz#1", [5, 6, 7], greedy)
    eng.add_request("b#beam0", [5, 6, 7], greedy)
    eng.add_request("zz", [8, 9, 10], two)
    eng.add_request("b", [11, 12, 13], beam)
    finals = {}
    for _ in range(200):
        if not eng.has_unfinished_requests():
            break
        finals.update({o.request_id: o for o in eng.step() if o.finished})
    assert sorted(finals) == ["b", "b#beam0", "zz", "zz#1"] and all(o.error is None for o in finals.values())
    assert finals["zz#1"].outputs[0].token_ids == finals["b#beam0"].outputs[0].token_ids == \
        alone[0].outputs[0].token_ids
    assert [c.token_ids for c in finals["zz"].outputs] == [c.token_ids for c in alone[1].outputs]
    assert [c.token_ids for c in finals["b"].outputs] == [c.token_ids for c in alone[2].outputs]
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("value", [1e308, -1100.0, float("inf"), float("-inf"), float("nan"), 10.5])
def test_length_penalty_out_of_range_is_refused_at_validation(value):
    """Beams score sum(logprob) / length ** length_penalty inside the step: 1e308 overflowed and -1100 divided
    by zero there, failing the engine (and with it every request of the server)."""
    with pytest.raises(ValueError, match=r"length_penalty must be in \[-10, 10\]"):
        SamplingParams(n=2, use_beam_search=True, max_tokens=4, length_penalty=value)
    SamplingParams(n=2, use_beam_search=True, max_tokens=4, length_penalty=-10.0)


def _changed(params: SamplingParams, **fields) -> SamplingParams:
    import copy

    p = copy.copy(params)
    for k, v in fields.items():
        setattr(p, k, v)
    return p


def test_offline_api_inputs_of_the_wrong_shape_fail_clearly_and_leave_the_engine_clean(make_llm):
    """What a probe of the Python API found failing deep inside the engine (AttributeError, a jinja error, a
    dict iterated as its keys); each now a TypeError or ValueError naming what is wrong, and the engine
    generates as before afterwards."""
    llm = make_llm()
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    before = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    cases = [
        (lambda: llm.generate("hi", {"max_tokens": 3}), TypeError, "sampling_params must be a SamplingParams"),
        (lambda: llm.generate(["a", "b"], [greedy, "x"]), TypeError, "got str"),
        (lambda: llm.generate(None), TypeError, "prompts must be"),
        (lambda: llm.generate(5), TypeError, "prompts must be"),
        (lambda: llm.generate({"text": "hi"}), ValueError, "prompt dict needs"),
        (lambda: llm.generate([[5, 6], [10**6], [7, 8]], greedy), ValueError, "prompt 1: "),
        (lambda: llm.chat("hello"), TypeError, "messages must be"),
        (lambda: llm.chat([{"role": "user"}]), ValueError, "chat template failed"),
        (lambda: SamplingParams(structured_outputs={"regex": "a+", "nope": 1}), ValueError, "structured_outputs"),
        (lambda: SamplingParams(structured_outputs=5), ValueError, "structured_outputs must be"),
        (lambda: SamplingParams(logit_bias=[1, 2]), ValueError, "logit_bias must be a dict"),
        (lambda: SamplingParams(logit_bias={"a": 1.0}), ValueError, "logit_bias must be keyed by token ids"),
        (lambda: SamplingParams(stop_token_ids=5), ValueError, "stop_token_ids must be a list"),
        (lambda: SamplingParams(n=True), ValueError, "n must be an integer, not a boolean"),
        (lambda: SamplingParams(max_tokens=True), ValueError, "max_tokens must be an integer, not a boolean"),
        (lambda: SamplingParams(allowed_token_ids=[True]), ValueError, "allowed_token_ids must be a list of token"),
        (lambda: llm.generate(["a", "b"], [greedy, None]), TypeError, "got NoneType"),  # was default params
        # fields changed after construction: checked again at admission (p.n = 0 failed deep in the output
        # processor; a seed past the n-th sample's range queued sample 0 before failing, and every later call
        # then failed on the orphan)
        (lambda: llm.generate([[5, 6]], _changed(greedy, n=0)), ValueError, "n must be an integer >= 1"),
        (lambda: llm.generate([[5, 6]], _changed(SamplingParams(n=2, max_tokens=3), seed=2**64 - 1)), ValueError,
         "seed must be an integer in"),
        (lambda: llm.generate([[5, 6]], _changed(greedy, stop_token_ids=None, max_tokens=0)), ValueError,
         "max_tokens must be an integer >= 1"),
        (lambda: SamplingParams(use_beam_search=True, n=2, max_tokens=3, logit_bias={5: 10.0}), ValueError,
         "logit_bias must be unset with use_beam_search"),
        (lambda: SamplingParams(use_beam_search=True, n=2, max_tokens=3, logprobs=2), ValueError,
         "logprobs must be unset with use_beam_search"),
        (lambda: llm.embed(None), TypeError, "prompts must be"),  # "'NoneType' object is not iterable"
        (lambda: llm.next_token_logprobs("hello"), TypeError, "sequences must be"),  # "token id h is out of range"
        (lambda: llm.next_token_logprobs(None), TypeError, "sequences must be"),
        (lambda: llm.next_token_logprobs([5, 6, 7], chunk=0), ValueError, "chunk must be an integer >= 1"),
        (lambda: llm.next_token_logprobs([[5, 6], "ab"]), TypeError, "sequences must be"),
    ]
    for call, kind, words in cases:
        with pytest.raises(kind, match=words):
            call()
        _assert_all_blocks_free(llm)
        assert not llm.engine.requests and not llm.engine.has_unfinished_requests()
    assert SamplingParams(bad_words="abc").bad_words == ["abc"]  # one word, not three letters
    gen = llm.generate([[5, 6, 7]], (p for p in [greedy]), use_tqdm=False)  # any iterable of params
    assert gen[0].outputs[0].token_ids == before
    assert llm.chat([]) == []
    assert len(llm.embed((5, 6, 7))) == 1  # a tuple of ids is one prompt, as a list is
    rows = llm.next_token_logprobs(range(5, 9), start=1)[0]  # any sequence of ids
    assert torch.equal(rows, llm.next_token_logprobs([5, 6, 7, 8], start=1)[0])
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.kind == "regex"
    text = next(t for t in ("a", "b", "x", "1") if max(llm.get_tokenizer().encode(t)) < 512)  # the tiny vocab
    assert llm.generate({"prompt": text}, greedy, use_tqdm=False)[0].prompt == text  # vLLM's TextPrompt
    assert llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids == before
    _assert_all_blocks_free(llm)
