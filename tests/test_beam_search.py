"""Beam search in the engine equals transformers' generate(num_beams=k, do_sample=False)."""

import json
import os
import random
import shutil
from collections import Counter

import pytest
import torch

from pagellm import LLM, BeamSearchParams, SamplingParams


@pytest.fixture(scope="module")
def tiny(tiny_hf_model):
    from transformers import AutoModelForCausalLM

    path = tiny_hf_model("llama")
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_beams(model, prompt, k, max_new, length_penalty, eos):
    out = model.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=k, do_sample=False,
                         max_new_tokens=max_new, length_penalty=length_penalty, eos_token_id=eos, pad_token_id=0,
                         early_stopping=False)
    return [r[len(prompt):].tolist() for r in out]


def assert_same_beams(ours, refs, pad=0):
    for o, r in zip(ours, refs, strict=True):
        assert r[:len(o)] == o
        assert all(t == pad for t in r[len(o):]), "transformers' longer tail must be padding only"


@pytest.mark.parametrize("k,length_penalty", [(2, 1.0), (4, 1.0), (3, 0.0), (4, 2.0)])
def test_beams_match_transformers_without_eos(tiny, smollm_gguf_path, k, length_penalty):
    path, model = tiny
    llm = LLM(path, tokenizer=smollm_gguf_path, block_size=4, kv_cache_memory="4MiB")
    rng = random.Random(k)
    prompt = [rng.randrange(3, 512) for _ in range(rng.randint(3, 20))]
    params = SamplingParams(use_beam_search=True, beam_width=k, n=k, max_tokens=10, ignore_eos=True,
                            length_penalty=length_penalty)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == hf_beams(model, prompt, k, 10, length_penalty, None)
    kv = llm.engine.kv_cache
    assert kv.pool.num_free == kv.num_blocks and kv.num_cow_copies > 0


def test_beams_match_transformers_with_eos(tiny, smollm_gguf_path, tmp_path):
    path, model = tiny
    # Make a token the model likes the EOS token, so beams really finish early.
    greedy = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, 4:].tolist()
    eos = Counter(greedy).most_common(1)[0][0]
    eos_dir = tmp_path / "eos-model"
    shutil.copytree(path, eos_dir)
    cfg = json.loads((eos_dir / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (eos_dir / "config.json").write_text(json.dumps(cfg))
    if os.path.exists(eos_dir / "generation_config.json"):
        os.remove(eos_dir / "generation_config.json")
    llm = LLM(str(eos_dir), tokenizer=smollm_gguf_path, block_size=4, kv_cache_memory="4MiB")
    eos_ids = sorted(llm.engine.eos_token_ids)
    stopped = 0
    for k, lp in ((2, 1.0), (3, 0.5)):
        for prompt in ([5, 6, 7, 8], [40, 41, 300, 7, 9]):
            out = llm.generate([prompt], SamplingParams(use_beam_search=True, beam_width=k, n=k, max_tokens=15,
                                                        length_penalty=lp), use_tqdm=False)[0]
            # transformers pads finished beams with eos_token_id[0] (its pad id 0 is falsy there).
            assert_same_beams([c.token_ids for c in out.outputs], hf_beams(model, prompt, k, 15, lp, eos_ids),
                              pad=eos_ids[0])
            stopped += sum(c.finish_reason == "stop" for c in out.outputs)
    assert stopped > 0, "no beam ended on EOS: the test would not exercise finished hypotheses"


def test_beam_search_in_a_mixed_batch_and_under_preemption(tiny, smollm_gguf_path):
    path, model = tiny
    prompt = [9, 8, 7, 6, 5, 4, 3]
    params = SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=12, ignore_eos=True)
    expected = hf_beams(model, prompt, 3, 12, 1.0, None)[:2]
    rng = random.Random(1)
    others = [[rng.randrange(3, 512) for _ in range(40)] for _ in range(6)]
    # 14 blocks of 4 tokens: the batch does not fit, so beams and others get preempted and resume.
    llm = LLM(path, tokenizer=smollm_gguf_path, block_size=4, kv_cache_memory=14 * 2 * 2 * 2 * 16 * 4 * 4)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([prompt] + others, [params] + [greedy] * 6, use_tqdm=False)
    assert [c.token_ids for c in outs[0].outputs] == expected
    assert llm.engine.scheduler.stats.num_preemptions > 0
    kv = llm.engine.kv_cache
    assert kv.pool.num_free == kv.num_blocks


def test_llm_beam_search_is_vllms_api(tiny, smollm_gguf_path):
    """vLLM's LLM.beam_search(prompts, BeamSearchParams): per prompt the beam_width best sequences, each with
    the prompt's ids then the generated ones (transformers' beams), its logprob sum and its decoded text."""
    path, model = tiny
    llm = LLM(path, tokenizer=smollm_gguf_path, block_size=4, kv_cache_memory="4MiB")
    prompts = [[5, 6, 7, 8], {"prompt_token_ids": [40, 41, 300, 7, 9]}, {"prompt": "is in the"}]
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    tok = llm.get_tokenizer()
    for prompt, out in zip([[5, 6, 7, 8], [40, 41, 300, 7, 9], tok.encode("is in the")], outs,
                           strict=True):
        refs = hf_beams(model, prompt, 3, 8, 1.0, None)
        assert [s.tokens for s in out.sequences] == [prompt + r for r in refs]
        scores = [s.cum_logprob / 8 for s in out.sequences]
        assert scores == sorted(scores, reverse=True) and all(s.finish_reason == "length" for s in out.sequences)
        assert [s.text for s in out.sequences] == [tok.decode(s.tokens, skip_special_tokens=False)
                                                   for s in out.sequences]
    with pytest.raises(ValueError, match="^temperature must be 0 with beam search"):
        llm.beam_search([[5, 6]], BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7))
    with pytest.raises(TypeError, match="^params must be a BeamSearchParams"):
        llm.beam_search([[5, 6]], SamplingParams(use_beam_search=True, max_tokens=4))
    kv = llm.engine.kv_cache
    assert kv.pool.num_free == kv.num_blocks


def test_beam_params_are_validated():
    with pytest.raises(ValueError, match="^n must be <= beam_width"):
        SamplingParams(use_beam_search=True, beam_width=2, n=3)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_beams_waiting_on_a_preempted_sibling_do_not_deadlock(tiny, smollm_gguf_path, mode):
    """A cache that holds one beam of the long prompt at a time: the beam that has its candidates waits for
    its preempted sibling, which needs the blocks the first one holds. The scheduler sets the idle beam
    aside (it used to wait forever), and the beams equal those of a cache big enough for both."""
    path, _ = tiny
    shared = list(range(40, 72))
    prompts = [shared + [5, 6], shared + [7, 8, 9], list(range(100, 190)), [3, 4, 5, 3, 4, 5, 3, 4]]
    params = SamplingParams(max_tokens=8, use_beam_search=True, beam_width=2, ignore_eos=True)
    small = LLM(path, tokenizer=smollm_gguf_path, block_size=4, kv_cache_memory="80KiB", max_num_batched_tokens=32,
                max_num_seqs=6, preemption_mode=mode, swap_space="1MiB")
    engine = small.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests() and engine.scheduler.stats.num_preemptions > 0
    big = LLM(path, tokenizer=smollm_gguf_path, block_size=4, kv_cache_memory="4MiB")
    got = small.generate(prompts, params, use_tqdm=False)
    ref = big.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in ref]
    assert engine.kv_cache.pool.num_free == engine.kv_cache.pool.num_blocks  # nothing leaked


def test_a_beam_search_keeps_its_arrival_place_under_preemption(tiny, smollm_gguf_path):
    # Preemption takes the latest arrival. Each beam step makes new requests: they must keep the search's place,
    # or a search that came first is preempted before everything that came after it, at every step.
    path, _ = tiny
    llm = LLM(path, tokenizer=smollm_gguf_path, block_size=4, kv_cache_memory=36 * 2 * 2 * 2 * 16 * 4 * 4)
    eng, rng = llm.engine, random.Random(0)
    eng.add_request("first", [rng.randrange(3, 512) for _ in range(20)],
                    SamplingParams(use_beam_search=True, beam_width=2, max_tokens=40, temperature=0, ignore_eos=True))
    for i in range(4):
        eng.add_request(f"later{i}", [rng.randrange(3, 512) for _ in range(20)],
                        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    order, steps = [], 0
    while eng.has_unfinished_requests() and steps < 2000:
        steps += 1
        order += [o.request_id for o in eng.step() if o.finished]
    assert eng.scheduler.stats.num_preemptions > 0
    assert order[0] == "first", order
    assert llm.engine.kv_cache.pool.num_free == llm.engine.kv_cache.num_blocks

