"""The bf16 flash-attention kernel for prefill chunks (kernels/cpu/prefill_attention.cpp), used under
`--dtype auto` where the CPU has AVX-512 BF16: against float32 SDPA over the same paged cache, with a
cached prefix or without, GQA, ragged lengths, float32, float16 and int8 caches. Tolerance: q, k, v and the
probabilities are rounded to bf16 (8 significant bits), sums stay float32; measured max |error| 0.009-0.018
on outputs of magnitude 1.6-3.7 (random q of std 2, keys and values of std 1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.kernels import ops
from pagellm.platforms import get_platform
from pagellm.platforms.cpu import PREFILL_ATTENTION
from pagellm.quant.kv_cache import dequantize_rows, quantize_rows

MAX_ABS_TOL = 0.05
MEAN_ABS_TOL = 5e-3
FIRST_TOKEN_TOL = 0.1  # nats

needs_kernel = pytest.mark.skipif(not ops.has_bf16_prefill_attention(),
                                  reason="this build has no bf16 prefill attention (no AVX-512 BF16)")
needs_tiles = pytest.mark.skipif(not ops.has_amx_prefill_attention(),
                                 reason="no AMX-BF16 tiles in this CPU, build or process")


def _paged(nq: int, seq_len: int, dtype: torch.dtype, heads=9, kv_heads=3, head_dim=64, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = -(-seq_len // block_size) + 5
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    blocks = torch.randperm(num_blocks, generator=g)[: -(-seq_len // block_size)]  # scattered, not in order
    table = torch.zeros(num_blocks, dtype=torch.int64)
    table[: len(blocks)] = blocks
    q = torch.randn(nq, heads, head_dim, generator=g) * 2
    k = cache[0, blocks].reshape(-1, kv_heads, head_dim)[:seq_len].float()
    v = cache[1, blocks].reshape(-1, kv_heads, head_dim)[:seq_len].float()
    mask = torch.arange(seq_len).unsqueeze(0) <= torch.arange(seq_len - nq, seq_len).unsqueeze(1)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=head_dim ** -0.5, enable_gqa=True)[0].transpose(0, 1)
    return q, cache, table, ref


@needs_kernel
@pytest.mark.parametrize("nq,seq_len", [(17, 17), (33, 50), (100, 100), (40, 1000), (300, 333), (1, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("tiles", [False, True])  # AMX tiles where they run here (else vdpbf16ps both times)
def test_matches_float32_sdpa_within_bf16_rounding(nq, seq_len, dtype, tiles):
    q, cache, table, ref = _paged(nq, seq_len, dtype)
    out = ops.prefill_attention_bf16(q, cache, table, seq_len, 64 ** -0.5, tiles=tiles)
    err = (out - ref).abs()
    assert err.max() < MAX_ABS_TOL and err.mean() < MEAN_ABS_TOL
    assert err.max() > 0  # bf16 really ran (a float32 path would be within 1e-5)


@needs_kernel
@pytest.mark.parametrize("nq,seq_len", [(33, 50), (300, 333)])
@pytest.mark.parametrize("tiles", [False, True])
def test_reads_int8_caches_as_their_dequantized_values(nq, seq_len, tiles):
    """An int8 cache (rows of head_dim codes and a float16 scale): as float32 SDPA over the dequantized rows,
    within the same bf16 tolerance."""
    q, cache, table, _ = _paged(nq, seq_len, torch.float32)
    stored = quantize_rows(cache, torch.int8)
    blocks = table[: -(-seq_len // 16)]
    k, v = (dequantize_rows(stored[i, blocks]).reshape(-1, 3, 64)[:seq_len] for i in (0, 1))
    mask = torch.arange(seq_len).unsqueeze(0) <= torch.arange(seq_len - nq, seq_len).unsqueeze(1)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=64 ** -0.5, enable_gqa=True)[0].transpose(0, 1)
    out = ops.prefill_attention_bf16(q, stored, table, seq_len, 64 ** -0.5, tiles=tiles)
    err = (out - ref).abs()
    assert err.max() < MAX_ABS_TOL and err.mean() < MEAN_ABS_TOL
    assert err.max() > 0


@needs_kernel
@pytest.mark.parametrize("tiles", [False, True])
def test_strided_query_rows_and_head_dim_128(tiles):
    q, cache, table, ref = _paged(70, 90, torch.float16, heads=4, kv_heads=2, head_dim=128)
    wide = torch.zeros(70, 2 * 4 * 128)
    wide[:, : 4 * 128] = q.reshape(70, -1)  # rows of a fused qkv output: stride 2 * H * D
    out = ops.prefill_attention_bf16(wide[:, : 4 * 128].view(70, 4, 128), cache, table, 90, 128 ** -0.5, tiles=tiles)
    assert (out - ref).abs().max() < MAX_ABS_TOL


def _growing_keys(seq_len: int, head_dim: int, growth: float, seed: int = 0):
    """A float32 cache (blocks in order) whose keys grow along the sequence, so every row's max keeps moving (the
    AMX items' lazy rescaling), q of std 4, and the float64 reference over the bf16-rounded q, k and v: what is
    left is the kernel's own error (probabilities in bf16, float32 sums)."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-seq_len // 16)
    cache = torch.randn(2, blocks, 16, 2, head_dim, generator=g)
    cache[0] *= (1 + growth * torch.arange(blocks * 16, dtype=torch.float32)).view(blocks, 16, 1, 1)
    q = torch.randn(64, 4, head_dim, generator=g) * 4
    k, v = (cache[i].reshape(-1, 2, head_dim)[:seq_len].to(torch.bfloat16).double() for i in (0, 1))
    s = torch.einsum("qhd,khd->hqk", q.to(torch.bfloat16).double(), k.repeat_interleave(2, dim=1)) * head_dim ** -0.5
    s[:, torch.arange(seq_len)[None] > torch.arange(seq_len - 64, seq_len)[:, None]] = float("-inf")
    ref = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v.repeat_interleave(2, dim=1))
    return q, cache, torch.arange(blocks, dtype=torch.int64), ref


@needs_kernel
@pytest.mark.parametrize("tiles", [False, True])
def test_peaked_rows_whose_max_keeps_moving_stay_at_the_bf16_error(tiles):
    """Measured max |error| ~1.1-1.4e-3 on both item kinds (outputs of magnitude ~4); a sum of exponentials that
    did not add the bf16 probabilities P V multiplies (with the AMX items' lazy max the top key's weight is not
    exactly 1) gave 7.5e-3 there."""
    q, cache, table, ref = _growing_keys(4096, 128, 0.05)
    out = ops.prefill_attention_bf16(q, cache, table, 4096, 128 ** -0.5, tiles=tiles)
    assert (out.double() - ref).abs().max() < 4e-3


@needs_kernel
@pytest.mark.parametrize("tiles", [False, True])
def test_a_rows_bits_do_not_depend_on_the_rows_in_its_item(tiles):
    """A cached prefix of 7 rows regroups the rows into other 16-row (AMX) or 8-row items: every row gets the same
    bits (an item-wide choice, such as whether a step rescales, would part them)."""
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 38, 16, 2, 64, generator=g).half()
    cache[0] *= (1 + 0.01 * torch.arange(38 * 16)).view(38, 16, 1, 1).half()
    table, q = torch.arange(38, dtype=torch.int64), torch.randn(600, 4, 64, generator=g) * 2
    whole = ops.prefill_attention_bf16(q, cache, table, 600, 0.125, tiles=tiles)
    assert torch.equal(whole[7:], ops.prefill_attention_bf16(q[7:], cache, table, 600, 0.125, tiles=tiles))


@needs_kernel
def test_declines_a_scale_that_is_not_positive():
    """The AMX items take max(raw scores) * scale for the max of the scaled scores: scale <= 0 goes elsewhere."""
    q, cache, table, _ = _paged(20, 20, torch.float16)
    for scale in (-0.125, 0.0, float("nan")):
        assert ops.prefill_attention_bf16(q, cache, table, 20, scale) is None


@needs_tiles
@pytest.mark.parametrize("nq,seq_len,head_dim", [(33, 77, 256), (16, 64, 64), (65, 130, 64), (5, 200, 128)])
def test_tiles_are_their_own_products_within_the_same_bounds(nq, seq_len, head_dim):
    """On AMX the products run on tiles (other summation orders than vdpbf16ps: not the same bits) and stay within
    the kernel's bounds: head_dim up to 256 (output tiles in groups of four), row counts around whole 16-row items
    and 64-key steps, a cached prefix."""
    q, cache, table, ref = _paged(nq, seq_len, torch.float16, heads=4, kv_heads=2, head_dim=head_dim)
    tiled = ops.prefill_attention_bf16(q, cache, table, seq_len, head_dim ** -0.5, tiles=True)
    vector = ops.prefill_attention_bf16(q, cache, table, seq_len, head_dim ** -0.5, tiles=False)
    assert not torch.equal(tiled, vector)
    for out in (tiled, vector):
        err = (out - ref).abs()
        assert err.max() < MAX_ABS_TOL and err.mean() < MEAN_ABS_TOL


@pytest.mark.parametrize("nq,seq_len", [(300, 333), (40, 1000), (17, 17)])
def test_backend_sdpa_mode_matches_float32_sdpa_within_bf16_rounding(nq, seq_len):
    """The AMX choice ("sdpa": bf16 SDPA over the gathered cache from SDPA_MIN_KEYS keys on, the kernel or bf16
    SDPA below) within the kernel's bounds; it runs on any CPU (torch's bf16 SDPA is portable, only slower)."""
    from pagellm.model.attention.base import AttentionMetadata
    from pagellm.model.attention.cpu_paged import CpuPagedAttention

    q, cache, table, ref = _paged(nq, seq_len, torch.float16)
    meta = AttentionMetadata(slot_mapping=None, block_tables=table[None], query_start_loc=[0, nq],
                             seq_lens=[seq_len], block_size=16)
    out = CpuPagedAttention("sdpa")._long_requests(q, cache, meta, 64 ** -0.5, [0])
    err = (out - ref).abs()
    assert out.dtype == torch.float32 and err.max() < MAX_ABS_TOL and err.mean() < MEAN_ABS_TOL
    assert err.max() > 0  # bf16 really ran


@needs_kernel
@pytest.mark.parametrize("tiles", [False, True])
def test_a_steps_chunks_in_one_call_get_the_bits_they_get_alone(tiles):
    """CpuPagedAttention's one call per step: three requests' chunks (a whole prompt, a chunk after a cached
    prefix, one row) and a decode row between them, over one int8 cache and one block table per request; each
    chunk's rows are what its own call gives, bit for bit, and the rows of no chunk stay as they were."""
    g = torch.Generator().manual_seed(3)
    num_blocks, bs = 64, 16
    cache = quantize_rows(torch.randn(2, num_blocks, bs, 3, 64, generator=g), torch.int8)
    tables = torch.zeros(4, 20, dtype=torch.int64)
    perm = torch.randperm(num_blocks, generator=g)
    tables[0, :5], tables[2, :16], tables[3, :2] = perm[:5], perm[5:21], perm[21:23]
    q = torch.randn(1 + 70 + 1 + 200 + 1, 9, 64, generator=g) * 2
    # (start, new rows, seq_len, table row): request 1 is a decode row left to the caller
    chunks = [(0, 70, 70, 0), (71, 1, 1, 3), (72, 200, 250, 2)]
    out = torch.full(q.shape, 7.0)
    assert ops.prefill_attention_bf16_batch(q, cache, tables, chunks, 0.125, out, tiles=tiles)
    for start, nq, seq_len, row in chunks:
        alone = ops.prefill_attention_bf16(q[start:start + nq], cache, tables[row], seq_len, 0.125, tiles=tiles)
        assert torch.equal(out[start:start + nq], alone)
    assert (out[70] == 7.0).all() and (out[272] == 7.0).all()
    untouched = out.clone()
    assert not ops.prefill_attention_bf16_batch(q, cache.float().to(torch.bfloat16), tables, chunks, 0.125, out)
    assert not ops.prefill_attention_bf16_batch(q.bfloat16(), cache, tables, chunks, 0.125, out)
    assert torch.equal(out, untouched)


def test_declines_what_it_does_not_take():
    q, cache, table, _ = _paged(20, 20, torch.float16, head_dim=32)
    assert ops.prefill_attention_bf16(q, cache, table, 20, 0.2) is None  # head_dim not a multiple of 64
    q, cache, table, _ = _paged(20, 20, torch.float16)
    assert ops.prefill_attention_bf16(q, cache.to(torch.bfloat16), table, 20, 0.2) is None  # no such KV format
    if not ops.has_bf16_prefill_attention():  # an AVX2 or portable build: never runs
        assert ops.prefill_attention_bf16(q, cache, table, 20, 0.2) is None


def test_platform_chooses_it_only_under_auto_with_bf16_dot_products(monkeypatch):
    p = get_platform("cpu")
    assert p.bf16_prefill_attention(False, torch.float16) is None  # --dtype float32 stays exact
    assert p.bf16_prefill_attention(True, torch.float8_e4m3fn) is None  # fp8 caches: float32 SDPA
    amx = "amx_bf16" in p.isa
    expected = (None if not (p.bf16_dot_products and p.native_kernels)
                else "sdpa" if amx and not ops.has_amx_prefill_attention() and not p.bf16dp_products
                else "kernel" if ops.has_bf16_prefill_attention() else None)
    assert p.bf16_prefill_attention(True, torch.float16) == expected
    assert p.bf16_prefill_attention(True, torch.int8) == expected
    chosen = p.bf16_prefill_attention(True, p.auto_kv_dtype(torch.float32))
    # what `pagellm info` and bench print; where prompt rows are int8 without bf16 (AVX2), their paged attention too
    auto = p.op_choices(torch.float32, auto=True)
    paged = ", under --dtype auto the paged kernel" if auto.int8_many_rows and not auto.bf16_gemm else ""
    assert p.describe()["prefill_attention"].startswith(PREFILL_ATTENTION[chosen] + paged)
    assert (", under" in p.describe()["prefill_attention"]) == bool(paged)
    assert ("prefill_attention " + PREFILL_ATTENTION[chosen]) in p.summary_line()
    if p.native_kernels:  # the platform decides from the ISA it probed, not from the build
        monkeypatch.setattr(p, "isa", [f for f in p.isa if f != "amx_bf16"] + ["amx_bf16"])
        # AMX: the own kernel on tiles where it has them, else torch's SDPA on oneDNN's tiles
        assert p.bf16_prefill_attention(True, torch.float16) == ("kernel" if ops.has_amx_prefill_attention()
                                                                 else "kernel" if p.bf16dp_products and
                                                                 ops.has_bf16_prefill_attention() else "sdpa")
        # AMX in the ISA but no tiles (a kernel without the tile state, or a build without them): the products take
        # vdpbf16ps and prompts one-plane int8 as on a Zen 4, so their marked chunks need the own kernel
        monkeypatch.setattr(ops, "has_amx_prefill_attention", lambda: False)
        if p.op_choices(torch.float32, auto=True).int8_many_rows:
            assert p.bf16_prefill_attention(True, torch.int8) == "kernel"
        monkeypatch.setattr(type(p), "bf16dp_products", property(lambda self: False))
        assert p.bf16_prefill_attention(True, torch.int8) == "sdpa"
        monkeypatch.undo()
        monkeypatch.setattr(p, "isa", [f for f in p.isa if f != "amx_bf16"] + ["avx512_bf16"])
        assert p.bf16_prefill_attention(True, torch.float16) == ("kernel" if ops.has_bf16_prefill_attention() else None)
    monkeypatch.setattr(p, "isa", [f for f in p.isa if f not in ("avx512_bf16", "amx_bf16")])
    assert p.bf16_prefill_attention(True, torch.float16) is None  # masked ISA
    assert p.describe()["prefill_attention"].startswith("torch SDPA")  # (AVX2 builds: and prompts' paged attention)


def test_engine_uses_it_under_auto_only_and_stays_close_to_its_float32_sdpa(smollm_gguf_path, monkeypatch):
    """The auto engine with each bf16 prefill path ("sdpa": torch's SDPA on bf16 inputs, which runs on any CPU;
    "kernel" where the build has it) against float32 SDPA: the next token's logprobs after prompts of 19-351
    tokens (each one long prefill chunk) move by < FIRST_TOKEN_TOL nats (measured <= 0.03 on the Zen 5 VM for
    the kernel), and a top-1 leading by more than 0.3 nats stays top-1."""
    from pagellm import LLM, SamplingParams

    p = get_platform("cpu")
    # the attention's own error: prompt products on bf16, not one-plane int8, whose rounding of each 32 values
    # turns the attention's small differences into larger ones (0.17 nats on the Zen 4 VM)
    monkeypatch.setenv("PAGELLM_CPU_INT8_PREFILL", "0")
    # prefix caching off: a later run would otherwise reuse the first run's KV and attend only its last block
    auto = LLM(smollm_gguf_path, dtype="auto", enable_prefix_caching=False)
    exact = LLM(smollm_gguf_path, dtype="float32")
    assert not getattr(exact.engine.runner.backend, "bf16_prefill", None)
    backend = auto.engine.runner.backend
    assert getattr(backend, "bf16_prefill", None) == p.bf16_prefill_attention(True, auto.engine.kv_dtype)
    if backend.name != "cpu_paged":  # no native kernels here: auto computes in float32 with torch SDPA
        return
    prompts = ["Once upon a time, " * 70,  # past SDPA_MIN_KEYS: "sdpa" takes torch SDPA for it
               "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
               "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
               "In 1969, the first humans landed on the Moon as part of NASA's Apollo program. The mission was called"]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    modes = [None, "sdpa"] + (["kernel"] if ops.has_bf16_prefill_attention() else [])
    runs = []
    for mode in modes:
        backend.bf16_prefill = mode
        runs.append([o.outputs[0] for o in auto.generate(prompts, params, use_tqdm=False)])
    for mode, run in zip(modes[1:], runs[1:], strict=True):
        moved = []
        for ref, out in zip(runs[0], run, strict=True):
            top = sorted(ref.logprobs[0].values(), key=lambda v: -v.logprob)
            if top[0].logprob - top[1].logprob > 0.3:
                assert out.token_ids == ref.token_ids
            if out.token_ids == ref.token_ids:
                t = ref.token_ids[0]
                moved.append(abs(out.logprobs[0][t].logprob - ref.logprobs[0][t].logprob))
                assert moved[-1] < FIRST_TOKEN_TOL
        assert moved and max(moved) > 0  # bf16 really ran
        print(f"bf16 prefill attention ({mode}) vs SDPA: next-token logprob moved by at most {max(moved):.4f} nats")


@pytest.mark.skipif(ops.cpu_kernels() is None, reason="no native kernels")
@pytest.mark.parametrize("mode", [None, "kernel"])
def test_verification_rows_attend_as_decode_rows_however_many_drafts(mode):
    """A request verifying 16 drafts has 17 rows, past the rows the decode kernel takes per request: they still
    attend through it (AttentionMetadata.query_drafts), bit for bit as one-row decode steps would, and a
    prefill chunk of as many rows takes the long-request path. (Found by a probe: with 16 or more drafts under
    --dtype auto the verification rows went to the bf16 prefill kernel and greedy tokens changed.)"""
    from pagellm.model.attention.base import AttentionMetadata
    from pagellm.model.attention.cpu_paged import CpuPagedAttention

    if mode == "kernel" and not ops.has_bf16_prefill_attention():
        pytest.skip("no bf16 prefill kernel in this build")
    nq, seq_len, bs = 17, 40, 16
    q, cache, table, _ = _paged(nq, seq_len, torch.float32)
    positions = torch.arange(seq_len - nq, seq_len)
    slots = table[positions // bs] * bs + positions % bs
    k, v = (cache[i].reshape(-1, 3, 64)[slots] for i in (0, 1))  # the rows already there: writing keeps them
    row_seq = torch.zeros(nq, dtype=torch.int64)

    def attend(drafts):
        meta = AttentionMetadata(slot_mapping=slots, block_tables=table[None], query_start_loc=[0, nq],
                                 seq_lens=[seq_len], block_size=bs, row_seq=row_seq, positions=positions,
                                 query_drafts=drafts)
        return CpuPagedAttention(mode).forward(q, k, v, cache, meta, 64 ** -0.5)

    decode = torch.cat([ops.paged_attention(q[i:i + 1], cache, table[None], row_seq[:1], positions[i:i + 1], None,
                                            64 ** -0.5) for i in range(nq)])
    assert torch.equal(attend([nq - 1]), decode)
    assert not torch.equal(attend(None), decode)


@needs_kernel
def test_a_prompts_rows_get_the_same_bits_however_it_is_chunked():
    """Rows marked as a prompt's chunk (AttentionMetadata.query_prompt, set by the model runner) take the bf16
    prompt kernel at any row count, so a prompt row's output does not depend on how the prompt was chunked, which
    differs between plain and speculative runs (their decode rows share the token budget differently). Unmarked,
    chunks of up to 16 rows take the decode kernel and part from the one-chunk rows."""
    from pagellm.model.attention.base import AttentionMetadata
    from pagellm.model.attention.cpu_paged import CpuPagedAttention

    seq_len, bs = 48, 16
    q, cache, table, _ = _paged(seq_len, seq_len, torch.float32)
    cache = quantize_rows(cache, torch.int8)  # auto's KV cache here

    def attend(start, end, marked):
        positions = torch.arange(start, end)
        slots = table[positions // bs] * bs + positions % bs
        k, v = (dequantize_rows(cache[i]).reshape(-1, 3, 64)[slots] for i in (0, 1))  # rewriting keeps the rows
        meta = AttentionMetadata(slot_mapping=slots, block_tables=table[None], query_start_loc=[0, end - start],
                                 seq_lens=[end], block_size=bs, row_seq=torch.zeros(end - start, dtype=torch.int64),
                                 positions=positions, query_prompt=[True] if marked else None)
        return CpuPagedAttention("kernel").forward(q[start:end], k, v, cache, meta, 64 ** -0.5)

    whole = attend(0, seq_len, True)
    for bounds in ((0, 10, 20, 30, 40, 48), (0, 17, 18, 47, 48)):
        pieces = list(zip(bounds, bounds[1:], strict=False))
        assert torch.equal(torch.cat([attend(a, b, True) for a, b in pieces]), whole)
    pieces = zip((0, 10, 20, 30, 40), (10, 20, 30, 40, 48), strict=True)
    assert not torch.equal(torch.cat([attend(a, b, False) for a, b in pieces]), whole)


@pytest.mark.slow
def test_a_prompts_last_row_alone_gets_the_same_logits_in_a_pruned_step(smollm_gguf_path):
    """A 17-token prompt with 16 tokens cached leaves a one-row chunk. Alone, its step's last layer runs every row
    (forward); beside a longer prompt, only the rows that sample (forward_rows). Where prompt chunks are marked for
    the prompt kernel (query_prompt), both give the row that kernel, so its logits do not depend on the other
    prompt (a review found forward_rows giving it the decode kernel)."""
    from pagellm import LLM, SamplingParams

    if not get_platform("cpu").op_choices(torch.float32, auto=True).int8_many_rows:
        # elsewhere a one-row step's products take the few-row kernels and a bigger one the GEMM: other bits
        pytest.skip("prompt chunks are marked only where prompts take one-plane int8 (AVX-512 BF16 + VNNI without "
                    "AMX, and AVX2)")
    llm = LLM(smollm_gguf_path, dtype="auto", enable_prefix_caching=True)
    short, other = list(range(2000, 2017)), list(range(5000, 5040))
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    llm.generate([{"prompt_token_ids": short}], params, use_tqdm=False)  # its first 16 tokens cached

    def logprobs(*prompts):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return outs[0].outputs[0].logprobs

    assert logprobs(short) == logprobs(short, other)
