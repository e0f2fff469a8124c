"""The native CPU kernels against the plain-torch code they replace, op by op and end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagellm.kernels import cpu_kernels, ops
from pagellm.model.attention.base import AttentionMetadata
from pagellm.model.attention.torch_sdpa_reference import TorchSdpaReferenceAttention
from pagellm.quant.formats import FORMATS, PackedWeight, group_size, pack_gguf_blocks
from pagellm.quant.kv_cache import dequantize_rows, quantize_rows

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="native CPU kernels could not be built here")


def _random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid GGUF bytes: finite f16 scales (and mins), random quants."""
    blocks = rng.integers(0, 256, size=(n * k // 32, FORMATS[kind]), dtype=np.uint8)
    blocks[:, 0:2] = np.float16(rng.uniform(0.001, 0.1, size=(len(blocks), 1))).view(np.uint8)
    if kind == "q4_1":
        blocks[:, 2:4] = np.float16(rng.uniform(-0.5, 0.1, size=(len(blocks), 1))).view(np.uint8)
    return blocks


def random_packed(kind: str, n: int, k: int, rng: np.random.Generator) -> PackedWeight:
    """A valid PackedWeight of any kind: GGUF bytes for q4_1/q8_0, else random codes (fp8: any non-NaN
    pattern) with scales in 0.001..0.1 and minimums in -0.5..0.1."""
    if kind in FORMATS:
        return pack_gguf_blocks(kind, _random_blocks(kind, n, k, rng), (n, k))
    groups = k // group_size(kind)
    d = torch.from_numpy(rng.uniform(0.001, 0.1, (n, groups)).astype(np.float32))
    with_m = kind in ("q8_1", "q4_1_16", "q8_1_16")
    m = torch.from_numpy(rng.uniform(-0.5, 0.1, (n, groups)).astype(np.float32)) if with_m else None
    if kind == "q4_1_16":
        return PackedWeight(kind, torch.from_numpy(rng.integers(0, 256, (n, k // 2), dtype=np.uint8)), d, m)
    if kind == "fp8_e4m3":
        qs = rng.integers(0, 256, (n, k), dtype=np.uint8)
        qs[(qs & 0x7F) == 0x7F] = 0x3B
        return PackedWeight(kind, torch.from_numpy(qs), d, m)
    return PackedWeight(kind, torch.from_numpy(rng.integers(-128, 128, (n, k), dtype=np.int8)), d, m)


@pytest.mark.parametrize("kind", sorted(ops.KIND_CODES))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 20])
def test_packed_linear_matches_float32_weights(kind, rows):
    """Equal to the float64 product up to float32 summation error, whatever the order the build sums in
    (SIMD lanes, or the portable build's sequential sum): |error| <= 2 k u sum_i |x_i w_i| + u |y|, u = 2^-24.
    Every row is computed alone, bit for bit (speculative verification must agree with one-row decoding)."""
    rng = np.random.default_rng(rows)
    n, k = 80, 96
    w = random_packed(kind, n, k, rng)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    ref = x.double() @ w.dequantize().double().t()
    got = ops.packed_linear(x, w)
    u = 2.0**-24
    bound = 2 * k * u * (x.double().abs() @ w.dequantize().double().abs().t()) + u * ref.abs()
    assert ((got.double() - ref).abs() <= bound).all()
    for r in range(rows):
        assert torch.equal(got[r], ops.packed_linear(x[r:r + 1], w)[0])
    # strided rows (a slice of a wider activation) give the same result
    wide = torch.randn(rows, k + 32)
    wide[:, :k] = x
    torch.testing.assert_close(ops.packed_linear(wide[:, :k], w), got)


def test_blas_matmul_layouts_and_checks():
    """OpenBLAS products (pagellm.kernels.blas) for the layouts the model passes: row-major and transposed
    weights, strided and broadcast rows; a shape mismatch is an error, not an out-of-bounds read."""
    from pagellm.kernels import blas

    w = torch.randn(96, 40)
    for x in (torch.randn(7, 96), torch.randn(7, 200)[:, :96], torch.randn(1, 96).expand(5, 96)):
        torch.testing.assert_close(blas.matmul(x, w), x @ w)
        torch.testing.assert_close(blas.matmul(x, w.t().contiguous().t(), torch.ones(40)), x @ w + 1)
    if blas.sgemm_available():
        with pytest.raises(ValueError, match="columns"):
            blas.matmul(torch.randn(3, 95), w)


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
    q, k = rot.rotate(pos, qkv[:, :32].reshape(4, 2, 16), qkv[:, 32:48].reshape(4, 1, 16))
    v = qkv[:, 48:].clone()
    ops.rope_(qkv, 3, 16, rot.cos, rot.sin, pos)
    torch.testing.assert_close(qkv[:, :32].reshape(4, 2, 16), q)
    torch.testing.assert_close(qkv[:, 32:48].reshape(4, 1, 16), k)
    assert torch.equal(qkv[:, 48:], v)

    gate_up = torch.randn(3, 40)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate_up[:, :20]) * gate_up[:, 20:])


F16_KV = pytest.param(torch.float16, marks=pytest.mark.skipif(
    cpu_kernels() is None or not ops.kv_dtype_supported(torch.float16), reason="no F16C in this build"))


@pytest.mark.parametrize("kv_dtype", [torch.float32, F16_KV])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_reference(window, kv_dtype):
    """A mixed step: a decode row, a 3-row verification, a 7-row prefill chunk on a cached prefix;
    blocks scattered through the cache; grouped-query heads. A float16 cache gets the same bits from
    the kernel's write as from torch's cast."""
    torch.manual_seed(0)
    block_size, num_blocks, kv_heads, heads, d = 4, 40, 2, 6, 16
    cache = torch.randn(2, num_blocks, block_size, kv_heads, d).to(kv_dtype)
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
    ref = TorchSdpaReferenceAttention().forward(q, k, v, ref_cache, meta, 0.25)
    ops.write_kv(k, v, cache, meta.slot_mapping)
    assert torch.equal(cache, ref_cache)
    got = ops.paged_attention(q, cache, meta.block_tables, meta.row_seq, meta.positions, window, 0.25)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16, 64, 256])
@pytest.mark.parametrize("kv_heads,heads,window", [(3, 9, None), (1, 4, None), (4, 4, 37), (2, 12, None)])
def test_many_row_decode_walks_match_reference(block_size, kv_heads, heads, window):
    """Decode steps of many rows take the walks that ask for memory ahead (whole tokens, each thread's next
    row, the look-ahead through the block table: kernels/cpu/paged_walk.h): every block size, MQA, MHA, more
    than 4 query heads per KV head, a sliding window, and (256-token blocks) a step whose longest row is past
    the whole-token limit (WHOLE_ROW_BYTES: 512 KB of K and V), which walks head by head; against the SDPA
    reference, and each row also as one alone (the same bits)."""
    torch.manual_seed(1)
    d, lens = 64, [1, 17, 33, 64, 100, 5, 250, 31]
    if block_size == 256:  # 9,000 keys of float32 K and V (at least 4.6 MB): past the whole-token limit
        lens[3] = 9000
    per = [-(-n // block_size) for n in lens]
    num_blocks = sum(per) + 3
    cache = torch.randn(2, num_blocks, block_size, kv_heads, d)
    perm = torch.randperm(num_blocks).tolist()
    table = torch.zeros(len(lens), max(per), dtype=torch.long)
    for i, n in enumerate(per):
        table[i, :n] = torch.tensor([perm.pop() for _ in range(n)])
    q = torch.randn(len(lens), heads, d)
    positions, row_seq = torch.tensor([n - 1 for n in lens]), torch.arange(len(lens))
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), table, list(range(len(lens) + 1)), lens, block_size,
                             window, row_seq, positions)
    ref = TorchSdpaReferenceAttention().attend(q, cache, meta, 0.125, range(len(lens)))
    got = ops.paged_attention(q, cache, table, row_seq, positions, window, 0.125)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for i in (0, 3, 6):  # few-row steps walk without asking ahead
        alone = ops.paged_attention(q[i:i + 1], cache, table, row_seq[i:i + 1], positions[i:i + 1], window, 0.125)
        assert torch.equal(alone, got[i:i + 1])


@pytest.mark.parametrize("kv_dtype", [torch.float32, F16_KV, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("kv_heads,heads,d", [(3, 9, 64), (1, 5, 128), (2, 16, 64), (2, 8, 64), (1, 7, 128)])
@pytest.mark.parametrize("window", [None, 37])
def test_paged_attention_row_does_not_depend_on_its_neighbours(kv_dtype, kv_heads, heads, d, window):
    """A row's output is bit-identical whether it is attended alone (split by head across threads) or
    among many rows (split by row; AVX-512 builds then take up to 4 query heads of a KV head at once,
    attention_grouped.h: groups of 3, 4 + 1, 4 + 4, 4 and 4 + 3 here; AVX2 builds up to 3, attention_grouped8.h:
    3, 3 + 2, 3 + 3 + 2, 2 + 2 and 3 + 2 + 2), whatever its length mod 4 (keys are scored four at a time): what keeps
    speculative verification rows equal to one-row decoding. int8 rows (the default under --dtype auto on
    AVX-512 BF16) carry their scale, applied per key on both paths, as e4m3's read scale is."""
    if kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and window and d == 64:
        pytest.skip("the fp8 formats take the same walks: D = 64 without a window and D = 128 cover them")
    torch.manual_seed(1)
    block_size, num_blocks = 16, 12
    values = torch.randn(2, num_blocks, block_size, kv_heads, d)
    cache = values.to(kv_dtype) if kv_dtype in (torch.float32, torch.float16) else quantize_rows(values, kv_dtype)
    table = torch.randperm(num_blocks)[:10].reshape(1, 10)
    positions = torch.tensor([3, 17, 18, 19, 20, 64, 101, 150])
    q = torch.randn(len(positions), heads, d)
    row_seq = torch.zeros(len(positions), dtype=torch.long)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # 8 rows >= 2 x threads: split by row; 1 row: split by head
        together = ops.paged_attention(q, cache, table, row_seq, positions, window, 0.125)
        for i in range(len(positions)):
            alone = ops.paged_attention(q[i:i + 1], cache, table, row_seq[:1], positions[i:i + 1], window, 0.125)
            assert torch.equal(alone[0], together[i])
    finally:
        torch.set_num_threads(threads)
    stored = dequantize_rows(cache)
    keys = stored[0][table[0]].reshape(-1, kv_heads, d)[:151]  # the request's keys in order
    vals = stored[1][table[0]].reshape(-1, kv_heads, d)[:151]
    i, p = 6, 101
    g = heads // kv_heads
    lo = 0 if window is None else max(0, p - window + 1)  # a sliding window: the last `window` keys
    k, v = keys[lo:p + 1].repeat_interleave(g, dim=1), vals[lo:p + 1].repeat_interleave(g, dim=1)
    want = torch.einsum("hk,khd->hd", torch.softmax(torch.einsum("hd,khd->hk", q[i], k) * 0.125, -1), v)
    # int8 keys on VNNI: the query's rounding (~1e-4 of its largest element) moves outputs by up to 8.3e-5 here
    tol = 2e-4 if kv_dtype == torch.int8 and ops.int8_keys_on_vnni() else 1e-5
    torch.testing.assert_close(together[i], want, rtol=tol, atol=tol)


def test_int8_keys_are_scored_on_vnni_where_the_build_targets_it():
    from pagellm.kernels.build import build_info

    isa = set(build_info()["isa"])
    assert ops.int8_keys_on_vnni() == ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vnni"} <= isa)


@pytest.mark.parametrize("d", [64, 128, 16])
def test_int8_attention_keeps_a_nan_query_to_its_head(d):
    """A head whose query is not finite gets NaN outputs (as float32 products give), its neighbours do not:
    the VNNI path rounds each head's query on its own (with d=16, the float path, where an inf query's scores
    are +-inf: exp(inf - inf) must stay NaN, which a clamp whose max/min drops NaN made ~0 for some seeds)."""
    torch.manual_seed(1)  # a seed whose d=16 case the NaN-dropping clamp failed
    block_size, kv_heads, heads = 16, 2, 4
    cache = quantize_rows(torch.randn(2, 4, block_size, kv_heads, d), torch.int8)
    table = torch.arange(4).reshape(1, 4)
    q = torch.randn(6, heads, d)
    q[2, 1, 5] = float("nan")
    q[3, 3, 0] = float("inf")
    out = ops.paged_attention(q, cache, table.expand(6, 4), torch.arange(6) * 0, torch.tensor([3, 17, 40, 41, 60, 63]),
                              None, 0.125)
    bad = {(2, 1), (3, 3)}
    for r in range(6):
        for h in range(heads):
            assert out[r, h].isnan().all() if (r, h) in bad else out[r, h].isfinite().all(), (r, h)



@pytest.mark.skipif(cpu_kernels() is None, reason="no native CPU kernels")
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_reads_quantized_caches(window, kv_dtype):
    """int8 (in-band scales) and fp8 caches: the kernel writes torch's bytes, reads them like the
    reference (within 1e-5: int8's scale is applied per key, not per element), and a row's output does
    not depend on its neighbours (bit-identical alone and among others)."""
    from pagellm.quant.kv_cache import kv_row_width

    torch.manual_seed(2)
    block_size, num_blocks, kv_heads, heads, d = 4, 40, 2, 6, 16
    cache = quantize_rows(torch.randn(2, num_blocks, block_size, kv_heads, d), kv_dtype)
    assert cache.shape[-1] == kv_row_width(d, kv_dtype)
    tables, slots, row_seq, positions, perm = [], [], [], [], torch.randperm(num_blocks).tolist()
    for i, (n, length) in enumerate([(1, 9), (3, 14), (7, 7)]):
        blocks = [perm.pop() for _ in range(-(-length // block_size))]
        tables.append(blocks + [0] * (4 - len(blocks)))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(length - n, length)]
        row_seq += [i] * n
        positions += range(length - n, length)
    q, k, v = torch.randn(11, heads, d), torch.randn(11, kv_heads, d), torch.randn(11, kv_heads, d)
    meta = AttentionMetadata(torch.tensor(slots), torch.tensor(tables), [0, 1, 4, 11], [9, 14, 7], block_size, window,
                             torch.tensor(row_seq), torch.tensor(positions))
    ref_cache = cache.clone()
    ref = TorchSdpaReferenceAttention().forward(q, k, v, ref_cache, meta, 0.25)
    ops.write_kv(k, v, cache, meta.slot_mapping)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    got = ops.paged_attention(q, cache, meta.block_tables, meta.row_seq, meta.positions, window, 0.25)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for i in range(11):
        alone = ops.paged_attention(q[i:i + 1], cache, meta.block_tables, meta.row_seq[i:i + 1],
                                    meta.positions[i:i + 1], window, 0.25)
        assert torch.equal(alone[0], got[i])

def test_engine_greedy_ids_equal_with_and_without_kernels(smollm_gguf_path, monkeypatch):
    """The packed few-row matmuls, fused norms/RoPE/SiLU and the native attention change only
    summation order: greedy ids over a batch with decode, prefill and n-gram verification agree."""
    from pagellm import LLM, SamplingParams

    prompts = ["The capital of France is", "def fib(n):\n    ", "List three colors: red, green,"]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    fast = LLM(smollm_gguf_path, speculative_method="ngram", speculative_adaptive=False)
    assert type(fast.engine.runner.backend).__name__ == "CpuPagedAttention"
    assert fast.engine.model.layers[0].mlp.gate_up_proj.packed is not None
    got = [o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("PAGELLM_CPU_KERNELS", "0")
    slow = LLM(smollm_gguf_path, attention_backend="batched")
    want = [o.outputs[0].token_ids for o in slow.generate(prompts, params, use_tqdm=False)]
    assert got == want


@pytest.mark.parametrize("dtype,int8_prefill", [(None, "1"), ("auto", "1"), ("auto", "0")])
def test_native_decoder_equals_module_path(smollm_gguf_path, dtype, int8_prefill, monkeypatch):
    """The one-call decoder runs the same kernels in the same order as the module-by-module native
    path, so few-row steps give bit-identical logits with it and without it (under auto on AVX-512 VNNI:
    the int8 tile-order products, Linear.int8_tiles, in both). Also where prompts do not take one-plane int8
    (PAGELLM_CPU_INT8_PREFILL=0, or AMX): there the decoder takes short prompts' steps, so the module path must
    attend them as it does (the decode kernel: a review found prompt chunks marked for the prompt kernel there)."""
    from pagellm import LLM, SamplingParams
    from pagellm.kernels import int8_tiles

    monkeypatch.setenv("PAGELLM_CPU_INT8_PREFILL", int8_prefill)

    llm = LLM(smollm_gguf_path, speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False,
              dtype=dtype)
    layer = llm.engine.model.layers[0].mlp.down_proj
    # (an AVX2 build keeps them for prompt rows under auto: OpChoices.int8_many_rows without bf16)
    assert (layer.int8_tiles is not None) == (layer.int8_activations > 0 and int8_tiles.available() or (
        layer.quant_method.choices.int8_many_rows and int8_tiles.avx2_rows()))
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3)
    # Each batch is one step's worth of prompts. The 18-token prompt alone has more new rows than the paged
    # kernel serves per request and fewer than the decoder's step limit: its prefill must take the module
    # path (SDPA) in both runs. The three short prompts (35 rows, past the few-row kernels' limit) prefill in a
    # step the decoder computes whole and the module path prunes to 3 rows in its last layer: the same bits.
    batches = [["Repeat: one two three one two three one two", "Hello"], [list(range(1000, 1018))],
               [list(range(2000, 2014)), list(range(3000, 3012)), list(range(4000, 4009))]]
    runner = llm.engine.runner
    compiled = runner.compiled_decoder
    assert compiled is not None
    for prompts in batches:
        runner.compiled_decoder = compiled
        llm.reset_prefix_cache()  # both runs compute every prompt from scratch
        with_native = llm.generate(prompts, params, use_tqdm=False)
        runner.compiled_decoder = None  # every step through the module path (the same kernels, op by op)
        llm.reset_prefix_cache()
        without = llm.generate(prompts, params, use_tqdm=False)
        for a, b in zip(with_native, without, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.parametrize("arch,qtype,tie,overrides", [
    ("qwen2", "Q4_1", False, {}),  # q/k/v biases through the native decoder
    ("llama", "Q8_0", True, {}),  # tied, packed LM head
    ("mistral", "Q8_0", False, {"sliding_window": 6}),
])
def test_native_paths_match_plain_torch_on_tiny_models(tiny_hf_model, tiny_gguf_model, smollm_gguf_path, monkeypatch,
                                                       arch, qtype, tie, overrides):
    """Greedy ids and logprobs with every native path on (packed GGUF matmuls, one-call decoder, native
    attention) equal the plain-torch engine's, for a batch mixing prefill and decode."""
    from pagellm import LLM, SamplingParams

    path = tiny_gguf_model(arch, qtype=qtype, tie=tie, **overrides)
    if overrides:  # GGUF has no sliding-window key: the HF directory carries it (float32, native attention)
        path = tiny_hf_model(arch, tie=tie, **overrides)
    prompts = [[5, 9, 33, 7, 100, 41, 3, 250, 19, 8, 77, 12], [60, 61, 62], [300, 4]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)

    def run(native: bool):
        monkeypatch.setenv("PAGELLM_CPU_KERNELS", "1" if native else "0")
        llm = LLM(path, tokenizer=smollm_gguf_path, attention_backend="auto" if native else "reference",
                  kv_cache_memory="8MiB")
        outs = llm.generate(prompts, params, use_tqdm=False)
        return llm, [o.outputs[0] for o in outs]

    llm, fast = run(True)
    assert type(llm.engine.runner.backend).__name__ == "CpuPagedAttention"
    if not overrides:
        assert llm.engine.runner.compiled_decoder, "the one-call decoder should serve these few-row steps"
    _, slow = run(False)
    for a, b in zip(fast, slow, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.keys() == lb.keys()
            for tok in la:
                assert abs(la[tok].logprob - lb[tok].logprob) < 1e-4


def test_packed_weights_only_gives_the_same_tokens_with_less_memory(smollm_gguf_path):
    """--packed-weights-only (the default) drops the float32 copies (layers and the tied embedding):
    prefill, many-row decode steps (more than PACKED_MAX_ROWS sequences) and the embedding lookup then
    read the GGUF blocks, dequantized to the same values, so greedy output equals that of an engine that
    keeps float32 copies."""
    from pagellm import LLM, SamplingParams
    from pagellm.quant.formats import PACKED_MAX_ROWS

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = [f"Item {i}: the capital of country number {i} in a long list of countries is" for i in
               range(PACKED_MAX_ROWS + 4)]
    full, slim = LLM(smollm_gguf_path, packed_weights_only=False), LLM(smollm_gguf_path)
    model = slim.engine.model
    assert model.layers[0].mlp.gate_up_proj.weight_t.numel() == 0 and model.embed_tokens.weight.numel() == 0
    assert full.engine.model.layers[0].mlp.gate_up_proj.weight_t.numel() > 0
    assert slim.engine.weights_bytes < full.engine.weights_bytes - 400 * 2**20
    a = full.generate(prompts, params, use_tqdm=False)
    b = slim.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly, tok in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, x.outputs[0].token_ids, strict=True):
            assert abs(lx[tok].logprob - ly[tok].logprob) < 1e-3
