"""Tensor and pipeline parallelism against one rank: worker processes over gloo (pagellm/executor).

Tiny random models in float32: greedy ids equal exactly, logprobs within 1e-4. SmolLM2 (GGUF Q4_1) TP=3
and PP=2: ids equal wherever the one-rank top-1 margin is clear. Engine features (prefix caching, chunked
prefill, preemption by recompute and swap, n > 1, beam search, n-gram speculation) give the outputs of
one rank.
"""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams

# every case starts 2-5 worker processes (~3-9 s each on a 2-core machine) besides its one-rank twin
pytestmark = pytest.mark.timeout(300)

PROMPTS = [[1, 5, 9, 17, 33, 65, 129], [2, 4, 8, 16, 32, 64, 128, 256, 3, 7, 11], [11, 12, 13], [300, 301, 302, 303]]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, logprobs=1, ignore_eos=True)


def _run(path, gguf, prompts, params, **kw):
    llm = LLM(path, tokenizer=gguf, kv_cache_memory=kw.pop("kv_cache_memory", "4MiB"), **kw)
    try:
        return llm.generate(prompts, params, use_tqdm=False), llm.engine.scheduler.stats
    finally:
        llm.shutdown()


def _chosen_logprobs(completion):
    return [lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs, strict=True)]


@pytest.mark.parametrize("arch,tp,pp", [("llama", 2, 1), ("llama", 4, 1), ("llama", 1, 2), ("llama", 2, 2),
                                        ("qwen2", 2, 1)],
                         ids=["tp2", "tp4-replicated-kv", "pp2", "tp2xpp2", "qwen2-tp2"])
def test_tiny_model_matches_one_rank_exactly(arch, tp, pp, tiny_hf_model, smollm_gguf_path):
    """TP=4 with 2 KV heads replicates each KV head on two ranks; qwen2 has q/k/v biases (column-split)."""
    path = tiny_hf_model(arch, num_hidden_layers=4 if pp > 1 else 2)
    one, _ = _run(path, smollm_gguf_path, PROMPTS, GREEDY)
    split, _ = _run(path, smollm_gguf_path, PROMPTS, GREEDY, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    for a, b in zip(one, split, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        diff = max(abs(x - y) for x, y in zip(_chosen_logprobs(a.outputs[0]), _chosen_logprobs(b.outputs[0]),
                                                 strict=True))
        assert diff < 1e-4, diff


SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                "List three colors:"]


@pytest.mark.parametrize("tp,pp", [(3, 1), (1, 2)], ids=["tp3", "pp2"])
def test_smollm2_gguf_split_matches_one_rank(tp, pp, smollm_gguf_path, capsys):
    """SmolLM2-135M: 9 query heads and 3 KV heads (TP=3: 3 and 1 per rank), 30 layers (PP=2: 15 each), its
    Q4_1 blocks cut at block boundaries. Greedy ids equal until a position where the one-rank top-1 margin is
    under 1e-3 (there the sums' order may flip it); the logprob differences are reported."""
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=2, ignore_eos=True)
    one, _ = _run(smollm_gguf_path, smollm_gguf_path, SMOL_PROMPTS, params, kv_cache_memory="32MiB")
    split, _ = _run(smollm_gguf_path, smollm_gguf_path, SMOL_PROMPTS, params, kv_cache_memory="32MiB",
                    tensor_parallel_size=tp, pipeline_parallel_size=pp)
    compared, close, worst = 0, 0, 0.0
    for a, b in zip(one, split, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        for t, (ta, tb) in enumerate(zip(ca.token_ids, cb.token_ids, strict=True)):
            top = sorted((v.logprob for v in ca.logprobs[t].values()), reverse=True)
            margin = top[0] - top[1]
            if margin < 1e-3:
                close += 1
                break  # from here the two may part legitimately
            assert ta == tb, (t, ca.token_ids, cb.token_ids)
            worst = max(worst, abs(ca.logprobs[t][ta].logprob - cb.logprobs[t][tb].logprob))
            compared += 1
    with capsys.disabled():
        print(f"\nSmolLM2 TP={tp} PP={pp}: {compared} positions equal, {close} under the 1e-3 margin, "
              f"max chosen-logprob difference {worst:.2e}")
    assert compared >= 4 * 32 - close * 32 and worst < 1e-3


def test_engine_features_under_tp2_and_pp2_match_one_rank(tiny_hf_model, smollm_gguf_path):
    """One batch exercising every path that moves KV: a shared prefix (prefix caching), a prompt longer
    than the step budget (chunked prefill), a KV cache too small for the batch (preemption: recompute for
    TP=2, swap for PP=2), n=2 (forks, copy-on-write) and beam search; then n-gram speculation."""
    path = tiny_hf_model("llama", num_hidden_layers=4)
    shared = list(range(40, 72))
    prompts = [shared + [5, 6], shared + [7, 8, 9], list(range(100, 190)), [3, 4, 5, 3, 4, 5, 3, 4]]
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    fork = SamplingParams(max_tokens=10, temperature=1.0, seed=4, n=2, ignore_eos=True)  # seeded: greedy would not fork
    beam = SamplingParams(max_tokens=8, use_beam_search=True, beam_width=2, ignore_eos=True)
    # 160 tokens of KV on every side (--kv-cache-memory is per rank, and a rank holds half the heads or
    # half the layers): fewer than the batch needs
    cache = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=6)
    for extra in (dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2, preemption_mode="swap",
                                                     swap_space="1MiB")):
        for params in (plain, fork, beam):
            ref, ref_stats = _run(path, smollm_gguf_path, prompts, params, kv_cache_memory="160KiB", **cache,
                                  **extra | {"tensor_parallel_size": 1, "pipeline_parallel_size": 1})
            got, stats = _run(path, smollm_gguf_path, prompts, params, kv_cache_memory="80KiB", **cache, **extra)
            assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in ref]
            if params is plain:  # the cache is small enough that the batch preempts, on both sides
                assert ref_stats.num_preemptions > 0 and stats.num_preemptions > 0
                if "swap_space" in extra:
                    assert stats.num_swapped_out > 0
    spec = dict(speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False)
    ref, _ = _run(path, smollm_gguf_path, prompts, plain, **spec)
    for split in (dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)):
        got, stats = _run(path, smollm_gguf_path, prompts, plain, **split, **spec)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
        assert stats.num_draft_tokens > 0


def test_embeddings_and_scoring_under_tp2_match_one_rank(tiny_hf_model, smollm_gguf_path):
    path = tiny_hf_model("llama")
    ids = [5, 9, 17, 33, 65, 7, 11]
    one = LLM(path, tokenizer=smollm_gguf_path, kv_cache_memory="4MiB")
    two = LLM(path, tokenizer=smollm_gguf_path, kv_cache_memory="4MiB", tensor_parallel_size=2)
    try:
        a, b = one.embed([ids])[0], two.embed([ids])[0]
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5
        la, lb = one.next_token_logprobs([ids]), two.next_token_logprobs([ids])
        assert (la[0] - lb[0]).abs().max() < 1e-4
    finally:
        two.shutdown()


def test_ray_backend_matches_one_rank(tiny_hf_model, smollm_gguf_path):
    """The same workers placed by Ray (pip install pagellm[ray]); skipped where Ray is not installed."""
    ray = pytest.importorskip("ray")
    path = tiny_hf_model("llama")
    one, _ = _run(path, smollm_gguf_path, PROMPTS, GREEDY)
    try:
        split, _ = _run(path, smollm_gguf_path, PROMPTS, GREEDY, tensor_parallel_size=2,
                        distributed_executor_backend="ray")
    finally:
        ray.shutdown()
    assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in one]


def test_shared_memory_all_reduce_matches_gloo_and_leaves_no_segment(tiny_hf_model, smollm_gguf_path):
    """TP ranks on one host sum through a shared-memory segment (the default), unlinked once every rank has
    mapped it: /dev/shm holds nothing of it even while the engine runs. Two ranks: a + b either way, so the
    logprobs equal gloo's bit for bit."""
    import os

    def segments():  # the all-reduce's own (other processes on the host create and remove files here too)
        return {f for f in os.listdir("/dev/shm") if f.startswith("pagellm-allreduce-")}

    path = tiny_hf_model("llama")
    before = segments()
    shm = LLM(path, tokenizer=smollm_gguf_path, kv_cache_memory="4MiB", tensor_parallel_size=2)
    try:
        assert segments() <= before
        a = shm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        shm.shutdown()
    b, _ = _run(path, smollm_gguf_path, PROMPTS, GREEDY, tensor_parallel_size=2, shm_allreduce=False)
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert _chosen_logprobs(x.outputs[0]) == _chosen_logprobs(y.outputs[0])


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_blocks_split_at_block_boundaries(quantization, tiny_hf_model, smollm_gguf_path):
    """int8 (q8_0 per channel) and int4 (q4_1, groups of 32) at load: the row-parallel layers' blocks are cut
    along their input columns (32 of the tiny model's 64 per rank), read by the same packed kernels."""
    path = tiny_hf_model("llama")
    kw = dict(quantization=quantization, **({"quantization_group_size": 32} if quantization == "int4" else {}))
    one, _ = _run(path, smollm_gguf_path, PROMPTS, GREEDY, **kw)
    split, _ = _run(path, smollm_gguf_path, PROMPTS, GREEDY, tensor_parallel_size=2, **kw)
    for a, b in zip(one, split, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        diff = max(abs(x - y) for x, y in zip(_chosen_logprobs(a.outputs[0]), _chosen_logprobs(b.outputs[0]),
                                                 strict=True))
        assert diff < 1e-4, diff


def test_a_result_too_big_for_the_shared_memory_channel_comes_through_gloo(tiny_hf_model, smollm_gguf_path):
    """Scoring 200 positions over a 49,152-token vocabulary returns 39 MB of logits in one result, more than
    the 16 MiB channel: the worker announces it there and sends it through gloo."""
    from pagellm.executor.transport import FROM_RESULT_BYTES

    path = tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024)
    ids = [(7 * i) % 49000 + 3 for i in range(200)]
    assert 200 * 49152 * 4 > FROM_RESULT_BYTES
    one = LLM(path, tokenizer=smollm_gguf_path, kv_cache_memory="16MiB")
    two = LLM(path, tokenizer=smollm_gguf_path, kv_cache_memory="16MiB", pipeline_parallel_size=2)
    try:
        assert type(two.engine.executor.transport).__name__ == "ShmTransport"
        a, b = one.next_token_logprobs([ids])[0], two.next_token_logprobs([ids])[0]
        assert a.shape == b.shape == (200, 49152) and (a - b).abs().max() < 1e-4
    finally:
        two.shutdown()
