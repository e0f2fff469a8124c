"""Every common GGUF block type stays quantized at run time (pagellm/quant/gguf_blocks.py): its packed form
holds exactly the floats gguf-py dequantizes, the kernels multiply by it as the dequantized matmul does, and a
model in that type generates what its dequantized float32 twin does while holding no float copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize

from pagellm import LLM, SamplingParams
from pagellm.kernels import blas, cpu_kernels, ops
from pagellm.quant.gguf_blocks import BLOCK_BYTES, PACKERS, pack_gguf_tensor

# Byte offsets of each type's f16 fields (scales, minimums): random bytes there could be inf/NaN.
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
              "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
# The kind each type is held as, and its bytes per weight in memory (codes + float32 d, m per group).
HELD = {"Q4_0": ("q4_1", 0.75), "Q4_1": ("q4_1", 0.75), "Q5_0": ("q8_0", 1.125), "Q5_1": ("q8_1", 1.25),
        "Q8_0": ("q8_0", 1.125), "Q2_K": ("q4_1_16", 1.0), "Q3_K": ("q4_1_16", 1.0), "Q4_K": ("q4_1", 0.75),
        "Q5_K": ("q8_1", 1.25), "Q6_K": ("q8_0_16", 1.25)}
NEW_TYPES = ["Q4_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]  # Q4_1/Q8_0 were packed before


def random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator, scale: float = 0.1) -> np.ndarray:
    """Valid raw GGUF bytes [n, bytes per row]: random codes and sub-block scales, finite f16 scales of
    either sign in (-scale, scale)."""
    nbytes, per_block = BLOCK_BYTES[qtype]
    b = rng.integers(0, 256, size=(n * k // per_block, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        b[:, off:off + 2] = np.float16(rng.uniform(-scale, scale, size=(len(b), 1))).view(np.uint8)
    return b.reshape(n, -1)


def shapes(qtype: str) -> list[tuple[int, int]]:
    """K of several blocks, and for the 32-weight types a K that is not a multiple of 256."""
    return [(12, 512), (5, 256)] if qtype.endswith("_K") else [(12, 512), (7, 96)]


@pytest.mark.parametrize("qtype", sorted(PACKERS))
def test_packed_form_is_bit_equal_to_gguf_dequantize(qtype):
    rng = np.random.default_rng(sorted(PACKERS).index(qtype))
    for n, k in shapes(qtype):
        raw = random_blocks(qtype, n, k, rng)
        pw = pack_gguf_tensor(qtype, raw, (n, k))
        ref = torch.from_numpy(dequantize(raw, Q[qtype]))
        assert (pw.kind, pw.out_features, pw.in_features) == (HELD[qtype][0], n, k)
        assert torch.equal(pw.dequantize(), ref), qtype
        assert pw.nbytes == HELD[qtype][1] * n * k  # memory per weight vs the file's BLOCK_BYTES ratio


def test_bad_sizes_and_types_are_refused_in_one_line():
    raw = random_blocks("Q4_K", 4, 256, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight: Q4_K \[4, 512\] is 1152 bytes, the file holds 576"):
        pack_gguf_tensor("Q4_K", raw, (4, 512), "blk.0.ffn_up.weight")
    with pytest.raises(ValueError, match="rows of whole 256-weight blocks, not K = 96"):
        pack_gguf_tensor("Q6_K", raw, (4, 96), "w")
    with pytest.raises(ValueError, match="IQ2_XS has no packed form"):
        pack_gguf_tensor("IQ2_XS", raw, (4, 256), "w")


@pytest.mark.skipif(cpu_kernels() is None, reason="native CPU kernels could not be built here")
@pytest.mark.parametrize("qtype", NEW_TYPES)
def test_kernels_multiply_like_the_dequantized_weight(qtype):
    """Few-row kernels (rows 1..20, each row bit-equal to computing it alone) and the many-row dequantizing
    sgemm equal x @ dequantize(W)^T up to float32 summation error (the bound of test_kernels.py)."""
    rng = np.random.default_rng(1)
    u = 2.0**-24
    for n, k in shapes(qtype):
        pw = pack_gguf_tensor(qtype, random_blocks(qtype, n, k, rng, scale=0.02), (n, k))
        w = pw.dequantize().double()
        x = torch.randn(20, k, generator=torch.Generator().manual_seed(k))
        ref = x.double() @ w.t()
        bound = 2 * k * u * (x.double().abs() @ w.abs().t()) + u * ref.abs()
        for rows in (1, 2, 4, 7, 8, 9, 16, 20):
            got = ops.packed_linear(x[:rows], pw)
            assert ((got.double() - ref[:rows]).abs() <= bound[:rows]).all(), (qtype, rows)
            assert torch.equal(got[-1], ops.packed_linear(x[rows - 1:rows], pw)[0])
        if blas.sgemm_available():
            many = torch.randn(40, k)
            ref = many.double() @ w.t()
            bound = 2 * k * u * (many.double().abs() @ w.abs().t()) + u * ref.abs()
            assert ((blas.packed_matmul(many, pw).double() - ref).abs() <= bound).all()


@pytest.mark.skipif(cpu_kernels() is None, reason="native CPU kernels could not be built here")
def test_fp8_kernels_decode_every_e4m3_pattern_exactly():
    """Weight pattern p alone in its row, x = e_5: y = f8(p) exactly (0x7F, 0xFF: NaN), few-row and many-row."""
    from pagellm.quant.formats import PackedWeight

    qs = torch.zeros(256, 32, dtype=torch.uint8)
    qs[:, 5] = torch.arange(256, dtype=torch.uint8)
    w = PackedWeight("fp8_e4m3", qs, torch.ones(256, 1), None)
    x = torch.zeros(1, 32)
    x[0, 5] = 1
    ref = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    outs = [ops.packed_linear(x, w)[0]] + ([blas.packed_matmul(x.expand(24, 32), w)[0]] if blas.sgemm_available()
                                           else [])
    for y in outs:
        assert y.isnan().nonzero().flatten().tolist() == [127, 255]
        assert torch.equal(y[ref == ref], ref[ref == ref])


TINY = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, vocab=512)
# K-quant weights are f16 super-scale * sub-block scale (up to 15..127) * code: a smaller super-scale keeps
# the tiny models' weights (and logits) of the same size for every type.
SUPER_SCALE = {"Q2_K": 0.02 / 8, "Q3_K": 0.02 / 16, "Q4_K": 0.02 / 32, "Q5_K": 0.02 / 32, "Q6_K": 0.02 / 64}


def write_tiny_gguf(path: str, qtype: str, seed: int = 0, types: dict[str, str] | None = None) -> str:
    """A tiny llama whose every matrix (lm_head included) is random raw blocks of `qtype`, or of
    types[short name] (e.g. {"attn_v": "Q6_K"}: a Q4_K_M-like mix)."""
    import gguf

    rng = np.random.default_rng(seed)
    t = TINY
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(t["layers"])
    w.add_context_length(256)
    w.add_embedding_length(t["hidden"])
    w.add_feed_forward_length(t["intermediate"])
    w.add_head_count(t["heads"])
    w.add_head_count_kv(t["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(t["vocab"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    hd, types = t["hidden"] // t["heads"], types or {}
    w.add_tensor("token_embd.weight", rng.standard_normal((t["vocab"], t["hidden"])).astype(np.float32))
    w.add_tensor("output_norm.weight", (1 + 0.2 * rng.standard_normal(t["hidden"])).astype(np.float32))

    def blocks(short: str, n: int, k: int) -> dict:
        qt = types.get(short, qtype)
        return dict(tensor=random_blocks(qt, n, k, rng, SUPER_SCALE.get(qt, 0.02)), raw_dtype=Q[qt])

    w.add_tensor("output.weight", **blocks("output", t["vocab"], t["hidden"]))
    for i in range(t["layers"]):
        for name, (n, k) in {"attn_q": (t["hidden"], t["hidden"]), "attn_k": (t["kv_heads"] * hd, t["hidden"]),
                             "attn_v": (t["kv_heads"] * hd, t["hidden"]), "attn_output": (t["hidden"], t["hidden"]),
                             "ffn_gate": (t["intermediate"], t["hidden"]), "ffn_up": (t["intermediate"], t["hidden"]),
                             "ffn_down": (t["hidden"], t["intermediate"])}.items():
            w.add_tensor(f"blk.{i}.{name}.weight", **blocks(name, n, k))
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", (1 + 0.2 * rng.standard_normal(t["hidden"])).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_shards_of_differing_kinds_meet_exactly_in_a_common_kind():
    """q/k in Q4_K beside v in Q6_K (llama.cpp's Q4_K_M) fuse as q8_1_16; Q4_0 beside Q8_0 as q8_1."""
    from pagellm.quant.formats import PackedWeight

    rng = np.random.default_rng(3)
    for types, common in ((["Q4_K", "Q4_K", "Q6_K"], "q8_1_16"), (["Q4_0", "Q8_0"], "q8_1"),
                          (["Q2_K", "Q4_1"], "q4_1_16"), (["Q5_K", "Q3_K"], "q8_1_16")):
        parts = [pack_gguf_tensor(t, random_blocks(t, 4 + i, 512, rng), (4 + i, 512)) for i, t in enumerate(types)]
        fused = PackedWeight.cat(PackedWeight.unify(parts))
        assert fused.kind == common
        assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    with pytest.raises(ValueError, match="a q8_0_16 weight cannot be held exactly as q4_1"):
        pack_gguf_tensor("Q6_K", random_blocks("Q6_K", 2, 256, rng), (2, 256)).as_kind("q4_1")


def _generate_like_float(path: str, tokenizer: str) -> LLM:
    """Greedy ids (logprobs within 1e-3) of the packed engine equal --quantization none's; returns it."""
    prompts = [[5, 9, 33, 7, 100, 41, 3, 250, 19, 8, 77, 12, 400, 23, 99, 101, 6, 88, 300, 17, 45, 46, 47, 48],
               [60, 61, 62], [300, 4]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    kw = dict(tokenizer=tokenizer, dtype="float32", kv_cache_memory="8MiB")
    packed, plain = LLM(path, **kw), LLM(path, quantization="none", **kw)
    model = packed.engine.model
    float_bytes = 4 * sum(m.weight_t.numel() for m in plain.engine.model.modules() if hasattr(m, "weight_t"))
    packed_bytes = sum(m.packed.nbytes for m in model.modules() if getattr(m, "packed", None) is not None)
    assert plain.engine.weights_bytes - packed.engine.weights_bytes == float_bytes - packed_bytes
    for a, b in zip(packed.generate(prompts, params, use_tqdm=False), plain.generate(prompts, params, use_tqdm=False),
                    strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb, tok in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids, strict=True):
            assert abs(la[tok].logprob - lb[tok].logprob) < 1e-3
    return packed


@pytest.mark.skipif(cpu_kernels() is None, reason="native CPU kernels could not be built here")
def test_a_q4_k_m_like_mix_runs_packed_and_generates_like_float(tmp_path, smollm_gguf_path):
    path = write_tiny_gguf(str(tmp_path / "tiny.mix.gguf"), "Q4_K",
                           types={"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"})
    llm = _generate_like_float(path, smollm_gguf_path)
    layer = llm.engine.model.layers[0]
    assert (layer.self_attn.qkv_proj.packed.kind, layer.mlp.gate_up_proj.packed.kind,
            layer.mlp.down_proj.packed.kind) == ("q8_1_16", "q4_1", "q8_0_16")
    assert llm.engine.runner.compiled_decoder is not None


@pytest.mark.skipif(cpu_kernels() is None, reason="native CPU kernels could not be built here")
@pytest.mark.parametrize("qtype", NEW_TYPES)
def test_model_in_each_type_generates_like_its_dequantized_twin(qtype, tmp_path, smollm_gguf_path):
    """Greedy float32 output through the packed kernels (one-call decoder, prefill on dequantized slices)
    equals --quantization none's (float32 weights); the float copies are freed. The same weights summed in
    another order: token ids equal, logprobs within 1e-3 (as test_kernels.py's packed-weights-only test)."""
    path = write_tiny_gguf(str(tmp_path / f"tiny.{qtype}.gguf"), qtype)
    model = _generate_like_float(path, smollm_gguf_path).engine.model
    assert model.layers[0].mlp.down_proj.packed.kind == HELD[qtype][0]
    assert model.layers[0].mlp.gate_up_proj.weight_t.numel() == 0  # float copy freed
