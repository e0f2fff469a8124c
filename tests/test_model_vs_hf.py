"""Greedy token ids through the whole engine equal transformers' generate() on the same weights."""

import random

import pytest
import torch

from pagellm import LLM, SamplingParams

MAX_NEW = 12


def hf_greedy(model_dir_or_model, prompts, max_new=MAX_NEW, **load_kw):
    from transformers import AutoModelForCausalLM

    model = model_dir_or_model
    if isinstance(model, str):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, **load_kw).eval()
    outs = []
    for p in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, min_new_tokens=max_new,
                                 pad_token_id=0, eos_token_id=None)
        outs.append(ids[0, len(p):].tolist())
    return outs


def random_prompts(n, vocab, seed=0, lo=3, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def engine_greedy(llm, prompts, max_new=MAX_NEW):
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


CASES = [
    ("llama", dict()),
    ("llama", dict(tie=True)),
    ("llama", dict(num_key_value_heads=1)),  # MQA
    ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    ("mistral", dict()),
    ("qwen2", dict()),
    ("qwen2", dict(tie=True)),
    # every layer slides (max_window_layers 0): prompts of up to 40 tokens against a window of 8
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)),
]


@pytest.mark.parametrize("arch,kw", CASES, ids=[f"{a}-{'-'.join(k) or 'base'}" for a, k in CASES])
def test_tiny_models_match_transformers(tiny_hf_model, smollm_gguf_path, arch, kw):
    path = tiny_hf_model(arch, **kw)
    prompts = random_prompts(6, 512, seed=len(arch))
    expected = hf_greedy(path, prompts)
    # A small block size and budget force multi-block tables and chunked prefill across steps.
    llm = LLM(path, tokenizer=smollm_gguf_path, block_size=4, max_num_batched_tokens=24,
              kv_cache_memory="4MiB")
    assert engine_greedy(llm, prompts) == expected


def test_smollm_gguf_matches_transformers(smollm_gguf_path, hf_gguf_model, hf_gguf_tokenizer):
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
             "The three primary colors are"]
    prompts = [hf_gguf_tokenizer.encode(t) for t in texts]
    expected = hf_greedy(hf_gguf_model, prompts, max_new=32)
    llm = LLM(smollm_gguf_path, kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # Top-5 logprobs of the first generated token agree with transformers'.
    with torch.no_grad():
        for p, o in zip(prompts, outs, strict=True):
            ref = torch.log_softmax(hf_gguf_model(torch.tensor([p])).logits[0, -1].float(), -1)
            top = ref.topk(5)
            ours = o.outputs[0].logprobs[0]
            for tid, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                assert tid in ours
                assert ours[tid].logprob == pytest.approx(lp, abs=2e-3)
