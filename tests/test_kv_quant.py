"""--kv-cache-dtype int8 | fp8 | fp8_e4m3 | fp8_e5m2: rows quantized on write (one format, bit for bit, in
the native kernel and in torch), read by every attention backend, carried by every block copy, and
engine output close to the float32 cache's (pagellm/quant/kv_cache.py has the formats)."""

import statistics

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.engine.engine_parts import kv_bytes_per_block
from pagellm.kernels import ops
from pagellm.model.attention.base import AttentionBackend, AttentionMetadata
from pagellm.model.attention.cpu_paged import CpuPagedAttention
from pagellm.model.attention.torch_sdpa_batched import TorchSdpaBatchedAttention
from pagellm.model.attention.torch_sdpa_reference import TorchSdpaReferenceAttention
from pagellm.quant.kv_cache import INT8_SCALE_BYTES, dequantize_rows, kv_row_width, quantize_rows

QUANT = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
NAMES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8_e5m2"}
needs_kernels = pytest.mark.skipif(not ops.kv_dtype_supported(torch.int8), reason="no native CPU kernels here")


def test_int8_rows_round_to_within_half_a_step():
    """|x - q * s| <= s / 2 per element, s the row's stored scale (absmax / 127 to float16 precision)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 64, generator=g) * torch.logspace(-4, 4, 64).view(64, 1, 1)
    x[0, 0] = 0.0  # an all-zero row: scale at its floor, values exact
    rows = quantize_rows(x, torch.int8)
    assert rows.shape == (64, 3, 64 + INT8_SCALE_BYTES) and rows.dtype == torch.int8
    scale = rows[..., 64:].contiguous().view(torch.float16).float()
    absmax = x.abs().amax(-1, keepdim=True)
    assert torch.all((scale - (absmax / 127).clamp(min=2 ** -14)).abs() <= scale * 2 ** -11)
    err = (dequantize_rows(rows) - x).abs()
    assert torch.all(err <= scale / 2)
    assert torch.all(dequantize_rows(rows)[0, 0] == 0)
    assert rows[..., :64].abs().max() == 127  # the largest element uses the full range


@pytest.mark.parametrize("dtype,mantissa_bits,min_normal,max_value", [
    (torch.float8_e4m3fn, 3, 2.0 ** -6, 448.0), (torch.float8_e5m2, 2, 2.0 ** -14, 57344.0)])
def test_fp8_rows_round_to_the_format(dtype, mantissa_bits, min_normal, max_value):
    """Normal values within half an ulp (relative 2^-(m+1)), subnormals within half a subnormal step,
    beyond the range saturated to the largest finite value (inf too)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=g) * torch.logspace(-8, 5.5, 4096)
    x = torch.cat([x, torch.tensor([max_value * 4, -max_value * 4, float("inf"), float("-inf")])])
    back = dequantize_rows(quantize_rows(x.view(1, 1, -1), dtype)).view(-1)
    a = x.abs()
    normal, sub, over = (a >= min_normal) & (a <= max_value), a < min_normal, a > max_value
    assert torch.all((back - x)[normal].abs() <= a[normal] * 2.0 ** -(mantissa_bits + 1))
    assert torch.all((back - x)[sub].abs() <= min_normal * 2.0 ** -(mantissa_bits + 1))
    assert torch.equal(back[over], x[over].sign() * max_value)
    inside = a <= max_value
    assert torch.equal(back[inside], x[inside].to(dtype).float())  # torch's own rounding in range


@needs_kernels
@pytest.mark.parametrize("dtype", [*QUANT, torch.float16, torch.float32])
def test_native_write_stores_the_same_bytes_as_torch(dtype):
    g = torch.Generator().manual_seed(2)
    t, kv, d, nb, bs = 40, 2, 64, 6, 16
    k = torch.randn(t, kv, d, generator=g) * 3
    v = torch.randn(t, kv, d, generator=g) * torch.logspace(-7, 3, d)
    k[0, 0, :8] = torch.tensor([1.0625, 1.1875, -2.0 ** -9 * 1.5, 2.0 ** -10, 449.0, -6e4, 1e-30, 0.0])  # ties, edges
    k[1] = 0.0
    k[2, 1, :] = 1e-6  # a row below float16's normal scales
    slots = torch.randperm(nb * bs, generator=g)[:t]
    shape = (2, nb, bs, kv, kv_row_width(d, dtype))
    native, torch_written = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    ops.write_kv(k, v, native, slots)
    AttentionBackend.write_kv(k, v, torch_written, slots)
    as_bytes = (lambda c: c.view(torch.uint8)) if dtype.itemsize == 1 else (lambda c: c)
    assert torch.equal(as_bytes(native), as_bytes(torch_written))


def _attention_step(dtype, backend, new_rows, chunk_at=3):
    """Four requests (three decode rows, one chunk of new_rows: the chunk_at-th) over a history written to a dtype
    cache."""
    h, kv, d, bs, nb = 8, 2, 64, 16, 48
    lens = [70, 33, 5, 100]
    new = [1, 1, 1, 1]
    new[chunk_at] = new_rows
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(3)).tolist()
    tables, i = [], 0
    for n in lens:
        tables.append(perm[i:i + -(-n // bs)])
        i += len(tables[-1])
    width = max(map(len, tables))
    block_tables = torch.tensor([b + [0] * (width - len(b)) for b in tables])
    cache = torch.zeros(2, nb, bs, kv, kv_row_width(d, dtype), dtype=dtype)
    g = torch.Generator().manual_seed(4)
    ks, vs, slots, row_seq, pos, starts = [], [], [], [], [], [0]
    for r, (n, m) in enumerate(zip(lens, new, strict=True)):
        sl = torch.tensor([tables[r][p // bs] * bs + p % bs for p in range(n)])
        k, v = torch.randn(n, kv, d, generator=g) * 2, torch.randn(n, kv, d, generator=g)
        AttentionBackend.write_kv(k[:n - m], v[:n - m], cache, sl[:n - m])  # the cached history
        ks.append(k[n - m:])
        vs.append(v[n - m:])
        slots.append(sl[n - m:])
        row_seq += [r] * m
        pos += range(n - m, n)
        starts.append(starts[-1] + m)
    q = torch.randn(sum(new), h, d, generator=g)
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), block_tables=block_tables, query_start_loc=starts,
                             seq_lens=lens, block_size=bs, row_seq=torch.tensor(row_seq),
                             positions=torch.tensor(pos))
    return backend.forward(q, torch.cat(ks), torch.cat(vs), cache, meta, d ** -0.5)


# Largest |output - float32-cache output| allowed (values ~ N(0, 1), keys ~ N(0, 4)); measured on this
# data: int8 0.028, e4m3 0.14, e5m2 0.29.
QUANT_TOLERANCE = {torch.int8: 0.05, torch.float8_e4m3fn: 0.25, torch.float8_e5m2: 0.5}


@pytest.mark.parametrize("new_rows,chunk_at", [(10, 3), (20, 3), (20, 1)])  # 20 > 16: cpu_paged hands that
@pytest.mark.parametrize("dtype", QUANT)  # request to SDPA, the decode rows to the kernel (in one run, or split)
def test_every_backend_reads_quantized_caches(dtype, new_rows, chunk_at):
    """Each backend vs the float32 cache within QUANT_TOLERANCE; the native kernel and the torch backends
    read the same stored rows and agree within 1e-5 (summation order, and int8's scale applied per key
    in the kernel instead of per element; 1e-3 where int8 keys are scored on VNNI)."""
    want = _attention_step(torch.float32, TorchSdpaReferenceAttention(), new_rows, chunk_at)
    ref = _attention_step(dtype, TorchSdpaReferenceAttention(), new_rows, chunk_at)
    assert 0 < (ref - want).abs().max() < QUANT_TOLERANCE[dtype]
    assert (_attention_step(dtype, TorchSdpaBatchedAttention(), new_rows, chunk_at) - ref).abs().max() < 1e-5
    if ops.kv_dtype_supported(dtype):
        # int8 keys on VNNI round the query to ~15 bits (attention_int8_vnni.h): 2e-4 here
        tol = 1e-3 if dtype == torch.int8 and ops.int8_keys_on_vnni() else 1e-5
        assert (_attention_step(dtype, CpuPagedAttention(), new_rows, chunk_at) - ref).abs().max() < tol


# ---- the engine ----------------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(20 + 9 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def make_llm(tiny_hf_model, smollm_gguf_path):
    path = tiny_hf_model("llama", max_position_embeddings=1024)

    def make(**kw):
        kw.setdefault("kv_cache_memory", "8MiB")
        return LLM(path, tokenizer=smollm_gguf_path, **kw)

    return make


def greedy_ids(llm, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("name,row_bytes", [("int8", 16 + 2), ("fp8", 16), ("fp8_e4m3", 16), ("fp8_e5m2", 16)])
def test_kv_cache_memory_holds_about_four_times_the_float32_tokens(make_llm, name, row_bytes):
    """Tiny model: 2 layers x 2 KV heads x head_dim 16, so per token K and V take 2 * 2 * 2 * 16 * 4 = 512
    bytes in float32, 2 * 2 * 2 * 18 = 144 in int8 (16 codes + a 2-byte scale per row), 128 in fp8."""
    f32, quant = make_llm(), make_llm(kv_cache_dtype=name)
    per_token = 2 * 2 * 2 * row_bytes
    assert quant.engine.bytes_per_block == 16 * per_token == kv_bytes_per_block(
        quant.engine.model_config, 16, quant.engine.kv_dtype)
    assert quant.engine.kv_cache.num_blocks == (8 << 20) // (16 * per_token)
    assert f32.engine.kv_cache.num_blocks == (8 << 20) // (16 * 512)
    cache = quant.engine.runner.kv_caches[0]
    assert cache.shape[-1] == row_bytes and cache.dtype.itemsize == 1
    ratio = quant.engine.kv_cache.num_blocks / f32.engine.kv_cache.num_blocks
    assert ratio == pytest.approx(512 / per_token, rel=1e-3)


@pytest.mark.parametrize("name", ["int8", "fp8", "fp8_e5m2"])
def test_backends_and_swap_agree_on_quantized_caches(make_llm, name):
    """Greedy ids equal on every backend (native, batched, reference) and across preemption by swapping
    (swap copies whole rows, int8 scales included)."""
    want = greedy_ids(make_llm(kv_cache_dtype=name, attention_backend="torch_sdpa_reference"))
    native = make_llm(kv_cache_dtype=name)
    if ops.kv_dtype_supported(torch.int8):
        assert type(native.engine.runner.backend).__name__ == "CpuPagedAttention"
    assert greedy_ids(native) == want
    assert greedy_ids(make_llm(kv_cache_dtype=name, attention_backend="torch_sdpa_batched")) == want
    per_block = native.engine.bytes_per_block
    small = make_llm(kv_cache_dtype=name, kv_cache_memory=24 * per_block, preemption_mode="swap")
    assert small.engine.kv_cache.num_blocks == 24
    assert greedy_ids(small) == want
    assert small.engine.scheduler.stats.num_preemptions > 0


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_prefix_cache_forks_and_beams_carry_quantized_blocks(make_llm, name):
    """A prefix-cache hit reads the blocks another request wrote; n=2 siblings share and copy-on-write
    the prompt's last block; beam search forks beams: all equal to computing everything alone."""
    shared = [(5 * j) % 400 + 7 for j in range(40)]  # 2.5 blocks shared
    prompts = [shared + [11, 12, 13], shared + [14, 15]]
    alone = [greedy_ids(make_llm(kv_cache_dtype=name, enable_prefix_caching=False), [p])[0] for p in prompts]
    llm = make_llm(kv_cache_dtype=name)
    assert greedy_ids(llm, prompts[:1]) == alone[:1]
    assert greedy_ids(llm, prompts[1:]) == alone[1:]
    assert llm.engine.kv_cache.prefix_hits >= 32
    sampled = dict(temperature=1.0, max_tokens=24, ignore_eos=True)  # seeded: n = 2 forks (greedy would not)
    two = llm.generate(prompts[:1], SamplingParams(n=2, seed=3, **sampled), use_tqdm=False)[0]
    solo = make_llm(kv_cache_dtype=name, enable_prefix_caching=False)
    assert [c.token_ids for c in two.outputs] == [
        solo.generate(prompts[:1], SamplingParams(seed=3 + i, **sampled), use_tqdm=False)[0].outputs[0].token_ids
        for i in range(2)]
    beam = SamplingParams(use_beam_search=True, beam_width=3, max_tokens=12, ignore_eos=True)
    ref = make_llm(kv_cache_dtype=name, attention_backend="torch_sdpa_reference", enable_prefix_caching=False)
    want = [c.token_ids for c in ref.generate(prompts[:1], beam, use_tqdm=False)[0].outputs]
    assert [c.token_ids for c in llm.generate(prompts[:1], beam, use_tqdm=False)[0].outputs] == want


def _logprob_drift(f32_outputs, quant_outputs):
    """(chosen-token |logprob difference| while outputs agree, float32 top-1 margins where they part)."""
    diffs, margins_at_split = [], []
    for a, b in zip(f32_outputs, quant_outputs, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        for tok_a, tok_b, lp_a, lp_b in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs, strict=True):
            if tok_a != tok_b:
                top2 = sorted((x.logprob for x in lp_a.values()), reverse=True)[:2]
                margins_at_split.append(top2[0] - top2[1])
                break
            diffs.append(abs(lp_a[tok_a].logprob - lp_b[tok_b].logprob))
    return diffs, margins_at_split


# name -> (median, max) chosen-token logprob difference allowed vs the float32 cache while the outputs
# agree, the float32 top-1 margin above which they must not part, and how many tokens must be compared
# at least. Tiny random model, 6 prompts x 24 tokens (its top-2 margins are often < 0.1, so fp8 parts
# early); measured median / max / tokens compared: int8 0.0044 / 0.020 / 144, fp8_e4m3 0.019 / 0.078 /
# 39, fp8_e5m2 0.035 / 0.17 / 29, every split at a float32 margin under 0.09.
TINY_BOUNDS = {"int8": (0.01, 0.05, 0.5, 100), "fp8": (0.05, 0.2, 0.5, 24), "fp8_e5m2": (0.08, 0.4, 0.5, 20)}


@pytest.mark.parametrize("name", list(TINY_BOUNDS))
def test_quantized_cache_stays_close_to_float32_on_a_tiny_model(make_llm, name):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    f32 = make_llm().generate(PROMPTS, params, use_tqdm=False)
    quant = make_llm(kv_cache_dtype=name).generate(PROMPTS, params, use_tqdm=False)
    diffs, margins = _logprob_drift(f32, quant)
    median, worst, margin, compared = TINY_BOUNDS[name]
    assert len(diffs) >= compared
    assert statistics.median(diffs) < median and max(diffs) < worst, (statistics.median(diffs), max(diffs))
    assert all(m < margin for m in margins), margins


# SmolLM2-135M (Q4_1 GGUF, one-call native decoder), 4 prompts x 32 greedy tokens, same bounds as above.
# Measured median / max / compared (float16 for scale: 0.0003 / 0.004 / 128): int8 0.0065 / 0.108 / 112
# (one split, margin 0.005), fp8_e4m3 0.021 / 0.175 / 53 (splits at margins <= 0.14), fp8_e5m2 0.035 /
# 0.52 / 57 (splits at margins <= 0.61). Its keys and values stay under 20 in magnitude, far inside
# e4m3's 448: the 3 mantissa bits set fp8's error, so a per-token scale would not reduce it.
SMOL_BOUNDS = {"int8": (0.02, 0.3, 0.5, 80), "fp8": (0.06, 0.6, 1.0, 40), "fp8_e5m2": (0.1, 1.5, 1.5, 40)}
SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                "The three primary colors are"]


@pytest.fixture(scope="module")
def smol_f32(smollm_gguf_path):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    return LLM(smollm_gguf_path, kv_cache_memory="64MiB").generate(SMOL_PROMPTS, params, use_tqdm=False)


@pytest.mark.parametrize("name", list(SMOL_BOUNDS))
def test_quantized_cache_stays_close_to_float32_on_smollm2(smollm_gguf_path, smol_f32, name):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    llm = LLM(smollm_gguf_path, kv_cache_memory="64MiB", kv_cache_dtype=name)
    if ops.kv_dtype_supported(torch.int8):  # the one-call decoder reads the quantized cache
        assert llm.engine.runner.compiled_decoder is not None
    diffs, margins = _logprob_drift(smol_f32, llm.generate(SMOL_PROMPTS, params, use_tqdm=False))
    median, worst, margin, compared = SMOL_BOUNDS[name]
    assert len(diffs) >= compared
    assert statistics.median(diffs) < median and max(diffs) < worst, (statistics.median(diffs), max(diffs))
    assert all(m < margin for m in margins), margins


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_ngram_speculation_and_module_path_equal_plain_decoding(smollm_gguf_path, name):
    """SmolLM2 with a quantized cache: n-gram verification rows give exactly what one-row decoding gives,
    and the one-call decoder gives exactly what the module path gives."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"  # drafts both accepted and rejected
    plain = LLM(smollm_gguf_path, kv_cache_dtype=name, kv_cache_memory="64MiB")
    spec = LLM(smollm_gguf_path, kv_cache_dtype=name, kv_cache_memory="64MiB", speculative_method="ngram",
               speculative_adaptive=False)
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want
    stats = spec.engine.scheduler.stats  # drafts were verified, and some accepted
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
    if plain.engine.runner.compiled_decoder is not None:
        assert plain.engine.runner.compiled_decoder.dims.kv_format == ops.kv_format_code(plain.engine.kv_dtype)
        plain.engine.runner.compiled_decoder = None  # the module path: same kernels, call by call
        assert plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want


def test_quantized_cache_names_resolve_and_bad_names_are_refused(make_llm):
    llm = make_llm(kv_cache_dtype="fp8")
    assert llm.engine.kv_dtype == torch.float8_e4m3fn
    assert make_llm(kv_cache_dtype="fp8_e4m3").engine.kv_dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        make_llm(kv_cache_dtype="int4")
