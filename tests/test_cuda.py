"""The whole engine on a GPU (`--device cuda`), against the CPU's float32 run on a tiny random Llama.

Marked `cuda` and skipped where torch sees no GPU (CI is CPU-only): `benchmarks/gpu_check.sh` runs it on a
GPU machine (`pytest -m cuda tests/test_cuda.py`). What it checks:
- float32 on the GPU gives the CPU's greedy tokens wherever the CPU's top two logprobs are more than
  1e-3 apart (float32 sums in another order on a GPU); bfloat16 wherever they are more than 1 nat apart;
- every KV block comes back when the requests finish, with CUDA graphs and without;
- CUDA graphs (padded decode batches replayed) and --enforce-eager give the same tokens;
- swap preemption (pinned host blocks, copies on a side stream) gives the unpreempted run's tokens;
- the KV cache is sized from --gpu-memory-utilization when --kv-cache-memory is not given.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.bench.random_model import write_random_llama

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible to torch", allow_module_level=True)

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def make(tmp_path_factory):
    """A tiny random Llama (2 layers, hidden 64, 4 heads / 2 KV heads, vocab 512) with its own id tokenizer:
    nothing but torch, safetensors and tokenizers needed. std 0.5 peaks the logits (median top-two margin
    ~0.9 nats) so that greedy runs have margins to compare on."""
    path = write_random_llama(str(tmp_path_factory.mktemp("tiny-cuda")), hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=512,
                              max_position_embeddings=1024, dtype=torch.float32, std=0.5, norm_std=0.2)

    def make_llm(device: str, **kw) -> LLM:
        kw.setdefault("kv_cache_memory", "16MiB")
        return LLM(path, device=device, **kw)

    return make_llm


def prompts(n: int, seed: int = 0, lo: int = 4, hi: int = 100) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(llm: LLM, ps, params=GREEDY):
    return [o.outputs[0] for o in llm.generate(ps, params, use_tqdm=False)]


def agreement(reference, other, margin: float) -> tuple[int, int]:
    """(tokens compared, tokens in all): each sequence is compared up to the first position where the
    reference's best two logprobs are within `margin` (past it the runs may rightly part). Asserts equality
    over the compared tokens."""
    compared = total = 0
    for ref, out in zip(reference, other, strict=True):
        total += len(ref.token_ids)
        for pos, (a, b) in enumerate(zip(ref.token_ids, out.token_ids, strict=True)):
            top = sorted((lp.logprob for lp in ref.logprobs[pos].values()), reverse=True)
            if len(top) > 1 and top[0] - top[1] < margin:
                break
            assert a == b, f"token {pos} differs ({a} vs {b}) where the reference led by {top[0] - top[1]:.4f}"
            compared += 1
    return compared, total


def assert_idle(llm: LLM) -> None:
    kv = llm.engine.kv_cache
    assert kv.pool.num_free == kv.num_blocks and not kv.req_blocks and not kv.req_host_blocks


@pytest.fixture(scope="module")
def cpu_reference(make):
    ps = prompts(12, seed=1)
    return ps, run(make("cpu", dtype="float32"), ps)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_float32_on_the_gpu_gives_the_cpu_tokens(make, cpu_reference, eager):
    ps, expected = cpu_reference
    llm = make("cuda", dtype="float32", enforce_eager=eager)
    assert llm.engine.device.type == "cuda" and llm.engine.runner.kv_caches[0].is_cuda
    compared, total = agreement(expected, run(llm, ps), margin=1e-3)
    assert compared >= total // 2, (compared, total)
    assert_idle(llm)


def test_bfloat16_matches_where_margins_allow(make):
    """bf16 rounds every product to 8 significant bits: on this peaked tiny model a logit moves by a few
    tenths of a nat, so tokens are compared where float32 on the CPU led by more than 1 nat, over 48 prompts
    (most first tokens, fewer later ones: a sequence is compared up to its first close call)."""
    ps = prompts(48, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    expected = run(make("cpu", dtype="float32"), ps, params)
    llm = make("cuda", dtype="auto")  # bf16 from sm80 on (float16 before)
    assert llm.engine.dtype in (torch.bfloat16, torch.float16)
    compared, total = agreement(expected, run(llm, ps, params), margin=1.0)
    assert compared >= 12, (compared, total)
    print(f"bfloat16: {compared} of {total} tokens compared (CPU float32 margin >= 1 nat), all equal")
    assert_idle(llm)


def test_cuda_graphs_and_eager_give_the_same_tokens(make):
    """Batches shrink as requests finish (7 -> 1 rows: padded to 8, 4, 2, 1): a graph's padding rows never
    change another row's tokens. float32, so the padded and unpadded products round alike enough."""
    ps = prompts(7, seed=2)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 5 * i, ignore_eos=True, logprobs=2) for i in range(7)]
    graphs = make("cuda", dtype="float32", max_num_seqs=8)
    runner = graphs.engine.runner.compiled_decoder
    eager = make("cuda", dtype="float32", max_num_seqs=8, enforce_eager=True)
    assert eager.engine.runner.compiled_decoder is None
    if graphs.engine.runner.backend.name == "triton_paged":
        assert runner is not None and runner.graphs and runner.sizes == (1, 2, 4, 8)
    with_graphs, without = run(graphs, ps, params), run(eager, ps, params)
    compared, total = agreement(without, with_graphs, margin=1e-4)
    assert compared >= total // 2, (compared, total)
    assert_idle(graphs)
    assert_idle(eager)
    # bfloat16 too, one request at a time. Not the same kernels: under a graph the Triton backend splits the keys
    # for the captured max_model_len, eagerly for the real lengths, and bf16 probabilities round per split; so
    # tokens must agree only where eager's top-1 leads by more than bf16 noise.
    one = [ps[0]]
    compared, total = agreement(run(make("cuda", dtype="auto", enforce_eager=True), one),
                                run(make("cuda", dtype="auto"), one), margin=0.05)
    assert compared >= total // 2, (compared, total)


def test_swap_preemption_on_the_gpu_matches_an_unpreempted_run(make):
    ps = prompts(10, seed=3, lo=10, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    expected = [o.token_ids for o in run(make("cuda", dtype="float32"), ps, params)]
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4  # K+V, 2 layers, 2 KV heads, head_dim 16, block 16, float32
    for mode in ("swap", "recompute"):
        llm = make("cuda", dtype="float32", kv_cache_memory=20 * block_bytes, preemption_mode=mode,
                   swap_space="1MiB")
        got = [o.token_ids for o in run(llm, ps, params)]
        stats = llm.engine.scheduler.stats
        assert stats.num_preemptions > 0, mode
        assert (stats.num_swapped_out > 0) == (mode == "swap")
        assert got == expected, mode
        if mode == "swap":
            assert llm.engine.runner.swap.host_cache.is_pinned()
        assert_idle(llm)


def test_kv_cache_sized_from_gpu_memory_utilization(make, caplog):
    """The budget counts every byte in use on the GPU (the CUDA context, this module's earlier engines until
    collected): 5% of the GPU leaves room for them."""
    gc.collect()
    torch.cuda.empty_cache()
    with caplog.at_level("INFO", logger="pagellm"):
        llm = make("cuda", dtype="auto", kv_cache_memory=None, gpu_memory_utilization=0.05)
    total = torch.cuda.get_device_properties(0).total_memory
    kv_bytes = llm.engine.kv_cache.num_blocks * llm.engine.bytes_per_block
    assert 0 < kv_bytes <= 0.05 * total
    assert "GPU memory: 0.05 x" in caplog.text and "pagellm plan predicts" in caplog.text
    run(llm, prompts(2, seed=4))
    assert_idle(llm)
    del llm
    torch.cuda.empty_cache()
