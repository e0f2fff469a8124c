"""The Triton paged-attention kernels and the `triton_paged` backend against the reference backend.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1): it must be
set before the kernels are decorated, i.e. before pagellm.kernels.triton's submodules are first imported,
so this module sets it before importing them. On a machine with CUDA the same tests run the compiled
kernels on the GPU (unless TRITON_INTERPRET=1 is set).

Every batch lays its blocks out in random order and fills every cache slot that no request owns (unused
blocks, the tail of each partial last block, the blocks that pad block_tables) with NaN, so a kernel that
reads a key it should not turns its row into NaN.
Tolerances against the reference in float32 on the same values: float32 1e-5; float16 2e-3; bfloat16 2e-2
(a bfloat16 output's rounding alone is up to 2^-9 relative, and on a GPU the probabilities are rounded to
bfloat16 before their product with V).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# the interpreter is slow: a case takes 0.1-1 s here; a hang or a pathological shape fails in time
pytestmark = pytest.mark.timeout(120)

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
_interpret = os.environ.get("TRITON_INTERPRET")
if not ON_GPU:
    # Read when a function is decorated with @triton.jit: triton.language decorates its own helpers
    # (tl.zeros, tl.max, ...) on import, so this comes before the first `import triton` of the process.
    os.environ["TRITON_INTERPRET"] = "1"
try:
    tl = pytest.importorskip("triton.language", reason="triton is not installed (pip install 'pagellm[cuda]')")
    from pagellm.kernels.triton import kv_write as kvw
    from pagellm.kernels.triton import paged_attention as pa
finally:  # the fixture below sets it again for this module's tests only
    if _interpret is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _interpret
if not ON_GPU and not (pa.is_interpreted(tl.zeros) and pa.is_interpreted(pa.paged_attention_kernel)):
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set (run this file on its own)",
                allow_module_level=True)

from pagellm.model.attention.base import AttentionMetadata  # noqa: E402
from pagellm.model.attention.selector import get_attention_backend  # noqa: E402
from pagellm.model.attention.torch_sdpa_reference import TorchSdpaReferenceAttention  # noqa: E402
from pagellm.model.attention.triton_paged import TritonPagedAttention  # noqa: E402
from pagellm.model.layers.rotary import RotaryEmbedding  # noqa: E402
from pagellm.platforms import get_platform  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture(autouse=True, scope="module")
def interpreter():
    """The interpreter reads TRITON_INTERPRET again at each launch."""
    if ON_GPU:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
REFERENCE = TorchSdpaReferenceAttention()


def make_batch(new_tokens, seq_lens, *, block_size=16, heads=4, kv_heads=2, head_dim=32, dtype=torch.float32,
               cache_dtype=None, window=None, seed=0):
    """q, k, v, a NaN-poisoned cache holding every request's cached prefix, and the metadata."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    spare = perm[:3]  # never owned: what block_tables is padded with
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"))
    tables, slots, starts = [], [], [0]
    width = max(blocks_per_req) + 2
    owned = perm[3:]
    for n_new, n in zip(new_tokens, seq_lens, strict=True):
        blocks = [owned.pop() for _ in range(-(-n // block_size))]
        tables.append(blocks + [spare[i % 3] for i in range(width - len(blocks))])
        flat = [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
        prefix = torch.tensor(flat[:n - n_new], dtype=torch.long)
        cache.view(2, -1, kv_heads, head_dim)[:, prefix] = torch.randn(2, len(prefix), kv_heads, head_dim,
                                                                       generator=gen)
        slots += flat[n - n_new:]
        starts.append(starts[-1] + n_new)
    t = starts[-1]
    q, k, v = (torch.randn(t, h, head_dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    meta = AttentionMetadata(torch.tensor(slots), torch.tensor(tables), starts, list(seq_lens), block_size, window)
    return (q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache.to(cache_dtype or dtype).to(DEVICE),
            to_device(meta))


def to_device(meta: AttentionMetadata) -> AttentionMetadata:
    meta.slot_mapping, meta.block_tables = meta.slot_mapping.to(DEVICE), meta.block_tables.to(DEVICE)
    return meta


def reference(q, k, v, cache, meta, scale=0.3):
    """The reference backend in float32 on the same values; returns (output, the cache after its write)."""
    ref_cache = cache.float().cpu()
    meta_cpu = AttentionMetadata(meta.slot_mapping.cpu(), meta.block_tables.cpu(), meta.query_start_loc,
                                 meta.seq_lens, meta.block_size, meta.sliding_window)
    out = REFERENCE.forward(q.float().cpu(), k.float().cpu(), v.float().cpu(), ref_cache, meta_cpu, scale)
    return out, ref_cache


def run_kernels(q, k, v, cache, meta, scale=0.3, **kwargs):
    kvw.write_kv(k, v, cache, meta.slot_mapping)
    return pa.paged_attention(q, cache, meta.block_tables, int32(meta.seq_lens), int32(meta.query_start_loc),
                              scale, meta.sliding_window, **kwargs)


def int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def assert_close(out, ref, dtype=torch.float32, msg=None):
    assert out.dtype == dtype and not out.isnan().any(), msg
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), ref, rtol=tol, atol=tol, msg=msg)


def same_bits(a, b):
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


# (new tokens per request, seq_lens, keyword overrides)
CASES = {
    "pure_decode": ([1, 1, 1, 1], [1, 17, 40, 64], {}),
    "pure_prefill_partial_last_blocks": ([5, 19, 16], [5, 19, 16], {}),
    "mixed": ([1, 7, 1, 20], [33, 7, 2, 20], {}),
    "chunked_prefill_after_cached_prefix": ([9, 16], [41, 48], {}),
    "gqa_4_per_kv_head": ([1, 6, 3], [20, 6, 30], {"heads": 8, "kv_heads": 2}),
    "mqa": ([1, 6, 3], [20, 6, 30], {"heads": 6, "kv_heads": 1}),
    "group_of_3_padded_to_4": ([2, 5], [9, 25], {"heads": 6, "kv_heads": 2}),
    "sliding_window": ([1, 12, 1, 30], [50, 12, 5, 45], {"window": 8}),
    "block_size_8": ([1, 11, 4], [23, 11, 30], {"block_size": 8}),
    "block_size_32": ([1, 11, 4], [70, 11, 30], {"block_size": 32}),
    "head_dim_48_padded": ([1, 6], [20, 30], {"head_dim": 48}),
    "head_dim_8_padded": ([1, 6], [20, 30], {"head_dim": 8}),
}


@pytest.mark.parametrize("case", CASES)
def test_float32_matches_reference(case):
    new, lens, kw = CASES[case]
    q, k, v, cache, meta = make_batch(new, lens, **kw)
    ref, ref_cache = reference(q, k, v, cache, meta)
    out = run_kernels(q, k, v, cache, meta)
    assert same_bits(cache, ref_cache)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_matches_reference(dtype):
    q, k, v, cache, meta = make_batch([1, 7, 1, 20], [33, 7, 2, 40], heads=8, kv_heads=2, head_dim=64,
                                      dtype=dtype, window=24)
    ref, ref_cache = reference(q, k, v, cache, meta)
    out = run_kernels(q, k, v, cache, meta)
    assert same_bits(cache.float(), ref_cache)
    assert_close(out, ref, dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_kv_write_rounds_float32_like_torch(cache_dtype):
    """A float32 model with a 16-bit cache: the kernel's cast gives torch's bits (round to nearest even),
    and a slot of -1 (a padding token) writes nothing."""
    q, k, v, cache, meta = make_batch([3, 1], [3, 9], cache_dtype=cache_dtype)
    # ties (halfway between two bfloat16 / float16 values: to the even one), a float32 subnormal, overflow
    k[0, 0, :8] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -11, 1 + 3 * 2 ** -11,
                                2.0 ** -130, 3.4e38, -65520.0])
    meta.slot_mapping[1] = -1
    expected = cache.clone()
    keep = meta.slot_mapping >= 0
    REFERENCE.write_kv(k[keep], v[keep], expected, meta.slot_mapping[keep])
    kvw.write_kv(k, v, cache, meta.slot_mapping)
    assert same_bits(cache, expected)


@pytest.mark.parametrize("num_splits", [2, 4])
def test_split_kv_matches_reference(num_splits):
    q, k, v, cache, meta = make_batch([1, 1, 1, 9], [70, 3, 129, 20], heads=4, kv_heads=2, window=40)
    ref, _ = reference(q, k, v, cache, meta)
    assert_close(run_kernels(q, k, v, cache, meta, num_splits=num_splits), ref)


def test_random_mixed_batches():
    rng = random.Random(17)
    for seed in range(4):
        b = rng.randint(1, 5)
        lens = [rng.randint(1, 70) for _ in range(b)]
        new = [1 if rng.random() < 0.5 else rng.randint(1, n) for n in lens]
        kv_heads = rng.choice([1, 2])
        kw = dict(block_size=rng.choice([8, 16, 32]), kv_heads=kv_heads, heads=kv_heads * rng.choice([1, 2, 3]),
                  head_dim=rng.choice([16, 32]), window=rng.choice([None, 5, 33]), seed=seed)
        q, k, v, cache, meta = make_batch(new, lens, **kw)
        ref, _ = reference(q, k, v, cache, meta)
        out = run_kernels(q, k, v, cache, meta, num_splits=rng.choice([1, 2]), tile_n=rng.choice([16, 32]),
                          block_q=rng.choice([None, 1, 2, 4]))
        assert_close(out, ref, msg=f"new {new}, seq_lens {lens}, {kw}")


def test_padded_batch_leaves_rows_of_no_request_alone():
    """A batch padded like a captured CUDA graph: query rows past query_start_loc[B] and their slots of -1
    are neither read nor written; the real rows equal an unpadded run."""
    q, k, v, cache, meta = make_batch([1, 4, 1], [30, 4, 9])
    ref, ref_cache = reference(q, k, v, cache, meta)
    pad = 3
    q = torch.cat([q, torch.full((pad, *q.shape[1:]), float("nan"), device=DEVICE)])
    k, v = (torch.cat([x, torch.full((pad, *x.shape[1:]), float("nan"), device=DEVICE)]) for x in (k, v))
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((pad,), -1, device=DEVICE)])
    for splits in (1, 2):
        out = torch.full(q.shape, 7.0, device=DEVICE)
        kvw.write_kv(k, v, cache, meta.slot_mapping)
        pa.paged_attention(q, cache, meta.block_tables, int32(meta.seq_lens), int32(meta.query_start_loc), 0.3,
                           out=out, num_splits=splits)
        assert same_bits(cache, ref_cache)
        assert_close(out[:-pad], ref)
        assert (out[-pad:] == 7.0).all()


def test_backend_through_the_selector():
    backend = get_attention_backend("triton_paged", get_platform("cpu"), torch.float32)
    assert isinstance(backend, TritonPagedAttention) and backend.name == "triton_paged"
    q, k, v, cache, meta = make_batch([1, 6, 1], [20, 6, 40], heads=6, kv_heads=2)
    ref, ref_cache = reference(q, k, v, cache, meta)
    assert_close(backend.forward(q, k, v, cache, meta, 0.3), ref)
    assert same_bits(cache, ref_cache)
    assert meta.seq_lens_t.dtype == torch.int32 and meta.query_start_loc_t.tolist() == meta.query_start_loc
    # Given tensors (a CUDA-graph runner's persistent ones) are what the kernels read; the lists then only
    # count the requests.
    q, k, v, cache, meta = make_batch([1, 6, 1], [20, 6, 40], heads=6, kv_heads=2)
    meta.query_start_loc_t, meta.seq_lens_t = int32(meta.query_start_loc), int32(meta.seq_lens)
    meta.query_start_loc, meta.seq_lens = [0] * 4, [0] * 3
    assert_close(backend.forward(q, k, v, cache, meta, 0.3), ref)
    # decode-only batches with split keys
    q, k, v, cache, meta = make_batch([1, 1], [40, 9], heads=6, kv_heads=2)
    ref, _ = reference(q, k, v, cache, meta)
    assert_close(TritonPagedAttention(decode_splits=2).forward(q, k, v, cache, meta, 0.3), ref)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_is_written_by_torch_and_read_by_the_kernel(cache_dtype):
    if ON_GPU and cache_dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton reads fp8 e4m3 on compute capability 8.9+")
    q, k, v, cache, meta = make_batch([1, 6, 1], [20, 6, 40], cache_dtype=cache_dtype)
    ref_cache = cache.clone()
    ref = REFERENCE.forward(q, k, v, ref_cache, meta, 0.3)
    out = TritonPagedAttention(cache_dtype).forward(q, k, v, cache, meta, 0.3)
    assert same_bits(cache, ref_cache)
    assert_close(out, ref.float().cpu())


def test_refusals_are_clear():
    with pytest.raises(ValueError, match="int8"):
        get_attention_backend("triton_paged", get_platform("cpu"), torch.int8)
    q, k, v, cache, meta = make_batch([1], [5])
    int8_cache = torch.zeros(2, 4, 16, 2, 34, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="int8"):
        TritonPagedAttention().forward(q, k, v, int8_cache, meta, 0.3)
    lens, starts = int32(meta.seq_lens), int32(meta.query_start_loc)
    with pytest.raises(ValueError, match="head_dim 512"):
        pa.paged_attention(q.new_zeros(1, 4, 512), cache.new_zeros(2, 4, 16, 2, 512), meta.block_tables, lens,
                           starts, 0.3)
    with pytest.raises(ValueError, match="not a multiple"):
        pa.paged_attention(q[:, :3], cache, meta.block_tables, lens, starts, 0.3)
    with pytest.raises(ValueError, match="int32"):
        pa.paged_attention(q, cache, meta.block_tables, lens.long(), starts, 0.3)
    with pytest.raises(ValueError, match="fp8 and int8 rows"):
        kvw.write_kv(k, v, cache.to(torch.float8_e5m2), meta.slot_mapping)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
def test_fused_rope_and_kv_write_match_the_unfused_path(dtype, cache_dtype):
    """qkv rotated in place like RotaryEmbedding.forward_native, the cache written like write_kv after it.
    Equal bits where both compute in float32; bfloat16 rotates in float32 here (once rounded) and in
    bfloat16 there, so q, k and the cache differ by the reference's own rounding (2e-2)."""
    heads, kv_heads, d = 6, 2, 32
    rotary = RotaryEmbedding(d, 64, 10000.0)
    q, k, v, cache, meta = make_batch([1, 6], [20, 6], heads=heads, kv_heads=kv_heads, head_dim=d,
                                      dtype=dtype, cache_dtype=cache_dtype)
    meta.slot_mapping[2] = -1  # a padding token: rotated, not written
    positions = torch.tensor([19, 0, 1, 2, 3, 4, 5], device=DEVICE)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    expected_qkv = rotary.forward_native(positions.cpu(), qkv.clone().cpu(), heads + kv_heads)
    expected_cache = cache.clone().cpu()
    keep = (meta.slot_mapping >= 0).cpu()
    rows = expected_qkv[keep, heads * d:].view(-1, 2, kv_heads, d)
    REFERENCE.write_kv(rows[:, 0], rows[:, 1], expected_cache, meta.slot_mapping.cpu()[keep])
    kvw.rope_write_kv(qkv, positions, rotary.cos.to(DEVICE), rotary.sin.to(DEVICE), cache, meta.slot_mapping,
                      heads, kv_heads)
    if dtype == torch.float32 and not ON_GPU:
        assert same_bits(qkv, expected_qkv) and same_bits(cache, expected_cache)
    else:  # (a GPU may contract x * cos - y * sin into an FMA)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(qkv.float().cpu(), expected_qkv.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(cache.float().cpu(), expected_cache.float(), rtol=tol, atol=tol, equal_nan=True)


# Compiled ahead of time in a fresh process (no GPU needed: Triton's own ptxas): the interpreter runs any
# Python, while the compiler refuses what a GPU cannot do (non-constexpr globals, loop values changing type,
# dtypes an architecture lacks).
COMPILE_FOR_GPU = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagellm.kernels.triton import kv_write as kvw, paged_attention as pa

def build(fn, pointers, constexprs, cc, floats=(), num_warps=4):
    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n in floats else "i32")
           for n in fn.arg_names}
    triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", cc, 32), options={"num_warps": num_warps})

attention = dict(GROUP=4, GROUP_PAD=4, BLOCK_Q=16, BLOCK_M=64, D_PAD=128, TILE_N=32, BLOCK_SIZE=16,
                 HAS_WINDOW=True, NUM_SPLITS=1, UPCAST_DOT=False, DOT_PRECISION=None)
for cc, q, cache, over in [(80, "bf16", "bf16", {}), (90, "fp16", "fp8e4nv", {}),
                           (80, "fp32", "fp32", dict(DOT_PRECISION="ieee", BLOCK_Q=8, BLOCK_M=32, TILE_N=16)),
                           (80, "bf16", "fp8e5", dict(GROUP=3, BLOCK_Q=1, BLOCK_M=16, NUM_SPLITS=4, D_PAD=256,
                                                      HAS_WINDOW=False, num_reqs=1))]:
    scratch = "*fp32" if over.get("NUM_SPLITS", 1) > 1 else "*" + q
    pointers = dict(out="*" + q, q="*" + q, cache="*" + cache, block_tables="*i64", seq_lens="*i32",
                    query_start_loc="*i32", partial_acc=scratch, partial_ml=scratch)
    build(pa.paged_attention_kernel, pointers, {**attention, **over}, cc, ("scale_log2",),
          8 if over.get("BLOCK_M", 64) >= 64 else 4)
build(pa.merge_splits_kernel, dict(out="*bf16", partial_acc="*fp32", partial_ml="*fp32", query_start_loc="*i32"),
      dict(NUM_SPLITS=4, D_PAD=128), 80)
for source, cache in [("bf16", "bf16"), ("fp32", "bf16"), ("fp32", "fp16")]:
    build(kvw.write_kv_kernel, dict(k="*" + source, v="*" + source, cache="*" + cache, slot_mapping="*i64"),
          dict(BLOCK_SIZE=16, KV_PAD=8, D_PAD=128), 80)
    build(kvw.rope_write_kv_kernel, dict(qkv="*" + source, positions="*i64", cos="*fp32", sin="*fp32",
                                         cache="*" + cache, slot_mapping="*i64"),
          dict(BLOCK_SIZE=16, ROT_PAD=16, KV_PAD=4, HALF_PAD=64, D_PAD=128), 80)
print("compiled")
"""


@pytest.mark.skipif(ON_GPU, reason="the other tests ran the compiled kernels")
def test_kernels_compile_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when it is unset
    r = subprocess.run([sys.executable, "-c", COMPILE_FOR_GPU], capture_output=True, text=True, timeout=110,
                       env=env, cwd=Path(__file__).resolve().parents[1])
    if "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("this triton has no ptxas to compile with")
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
