"""The native CPU kernels against the plain-torch code they replace, op by op and end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagellm.kernels import cpu_kernels, ops
from pagellm.model.attention.base import AttentionMetadata
from pagellm.model.attention.reference import ReferenceAttention
from pagellm.model.layers.quant import FORMATS, PackedWeight, pack_gguf_blocks

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="native CPU kernels could not be built here")


def _random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid GGUF bytes: finite f16 scales (and mins), random quants."""
    blocks = rng.integers(0, 256, size=(n * k // 32, FORMATS[kind]), dtype=np.uint8)
    blocks[:, 0:2] = np.float16(rng.uniform(0.001, 0.1, size=(len(blocks), 1))).view(np.uint8)
    if kind == "q4_1":
        blocks[:, 2:4] = np.float16(rng.uniform(-0.5, 0.1, size=(len(blocks), 1))).view(np.uint8)
    return blocks


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 20])
def test_packed_linear_matches_float32_weights(kind, rows):
    rng = np.random.default_rng(rows)
    n, k = 80, 96
    w = pack_gguf_blocks(kind, _random_blocks(kind, n, k, rng), (n, k))
    x = torch.randn(rows, k)
    ref = (x.double() @ w.dequantize().double().t()).float()
    got = ops.packed_linear(x, w)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # strided rows (a slice of a wider activation) give the same result
    wide = torch.randn(rows, k + 32)
    wide[:, :k] = x
    torch.testing.assert_close(ops.packed_linear(wide[:, :k], w), got)


def test_pack_gguf_blocks_matches_loader_dequantization(smollm_gguf_path):
    from pagellm.model.loader.gguf_loader import dequantize_tensor
    from pagellm.model.loader.gguf_reader import GGUFFile

    gf = GGUFFile(smollm_gguf_path)
    for name, kind in [("blk.0.ffn_down.weight", "q4_1"), ("token_embd.weight", "q8_0")]:
        info = gf.tensors[name]
        assert torch.equal(pack_gguf_blocks(kind, gf.raw(name), info.shape).dequantize(),
                           dequantize_tensor(gf, name))


def test_packed_weight_rows_and_cat():
    rng = np.random.default_rng(0)
    a = pack_gguf_blocks("q4_1", _random_blocks("q4_1", 6, 64, rng), (6, 64))
    b = pack_gguf_blocks("q4_1", _random_blocks("q4_1", 4, 64, rng), (4, 64))
    perm = torch.tensor([3, 1, 0, 2, 5, 4])
    assert torch.equal(a.rows(perm).dequantize(), a.dequantize()[perm])
    assert torch.equal(PackedWeight.cat([a, b]).dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    q8 = pack_gguf_blocks("q8_0", _random_blocks("q8_0", 4, 64, rng), (4, 64))
    assert PackedWeight.cat([a, q8]) is None  # mixed formats stay float32


def test_add_rmsnorm_rope_silu_match_torch():
    from pagellm.model.layers.rotary import RotaryEmbedding

    x, res, w = torch.randn(5, 48), torch.randn(5, 48), torch.randn(48)
    summed = x + res
    ref = w * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5))
    got = ops.add_rmsnorm(x, res, w, 1e-5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x, summed)  # the residual stream, updated in place

    rot = RotaryEmbedding(16, 64, 10000.0)
    qkv = torch.randn(4, 3 * 16 + 16)  # 2 q heads + 1 k head rotated, 1 v head left alone
    pos = torch.tensor([0, 5, 17, 63])
    q, k = rot(pos, qkv[:, :32].reshape(4, 2, 16), qkv[:, 32:48].reshape(4, 1, 16))
    v = qkv[:, 48:].clone()
    ops.rope_(qkv, 3, 16, rot.cos, rot.sin, pos)
    torch.testing.assert_close(qkv[:, :32].reshape(4, 2, 16), q)
    torch.testing.assert_close(qkv[:, 32:48].reshape(4, 1, 16), k)
    assert torch.equal(qkv[:, 48:], v)

    gate_up = torch.randn(3, 40)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate_up[:, :20]) * gate_up[:, 20:])


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_reference(window):
    """A mixed step: a decode row, a 3-row verification, a 7-row prefill chunk on a cached prefix;
    blocks scattered through the cache; grouped-query heads."""
    torch.manual_seed(0)
    block_size, num_blocks, kv_heads, heads, d = 4, 40, 2, 6, 16
    cache = torch.randn(2, num_blocks, block_size, kv_heads, d)
    new_rows, seq_lens = [1, 3, 7], [9, 14, 7]
    perm = torch.randperm(num_blocks).tolist()
    tables, slots, row_seq, positions = [], [], [], []
    for i, (n, L) in enumerate(zip(new_rows, seq_lens, strict=True)):
        blocks = [perm.pop() for _ in range(-(-L // block_size))]
        tables.append(blocks + [0] * (4 - len(blocks)))
        for p in range(L - n, L):
            slots.append(blocks[p // block_size] * block_size + p % block_size)
            row_seq.append(i)
            positions.append(p)
    t = sum(new_rows)
    q, k, v = torch.randn(t, heads, d), torch.randn(t, kv_heads, d), torch.randn(t, kv_heads, d)
    meta = AttentionMetadata(torch.tensor(slots), torch.tensor(tables), [0, 1, 4, 11], seq_lens, block_size, window,
                             torch.tensor(row_seq), torch.tensor(positions))
    ref_cache = cache.clone()
    ref = ReferenceAttention().forward(q, k, v, ref_cache, meta, 0.25)
    ops.write_kv(k, v, cache, meta.slot_mapping)
    assert torch.equal(cache, ref_cache)
    got = ops.paged_attention(q, cache, meta.block_tables, meta.row_seq, meta.positions, window, 0.25)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_engine_greedy_ids_equal_with_and_without_kernels(smollm_gguf_path, monkeypatch):
    """The packed few-row matmuls, fused norms/RoPE/SiLU and the native attention change only
    summation order: greedy ids over a batch with decode, prefill and n-gram verification agree."""
    from pagellm import LLM, SamplingParams

    prompts = ["The capital of France is", "def fib(n):\n    ", "List three colors: red, green,"]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    fast = LLM(smollm_gguf_path, speculative_method="ngram")
    assert type(fast.engine.runner.backend).__name__ == "NativeCpuAttention"
    assert fast.engine.model.layers[0].mlp.gate_up_proj.packed is not None
    got = [o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(ops, "ENABLED", False)
    slow = LLM(smollm_gguf_path, attention_backend="batched")
    want = [o.outputs[0].token_ids for o in slow.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_native_decoder_equals_module_path(smollm_gguf_path):
    """The one-call decoder runs the same kernels in the same order as the module-by-module native
    path, so few-row steps give bit-identical logits with it and without it."""
    from pagellm import LLM, SamplingParams

    llm = LLM(smollm_gguf_path, speculative_method="ngram", num_speculative_tokens=3)
    model = llm.engine.model
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3)
    prompts = ["Repeat: one two three one two three one two", "Hello"]
    with_native = llm.generate(prompts, params, use_tqdm=False)
    assert model._native
    model._native = False
    llm.reset_prefix_cache()  # recompute the prompts the same way as the first run
    without = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(with_native, without, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
