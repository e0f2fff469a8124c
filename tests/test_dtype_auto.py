"""`--dtype auto` on a CPU with bf16 dot products (AVX-512 BF16, AMX): many-row products (prefill, decode
steps of more than 20 rows) multiply bfloat16 copies of the weights and activations with float32
accumulation, and the KV cache is int8 rows with a float16 scale where both attention kernels read them (else
float16 where the paged kernel reads that); few-row steps, attention's arithmetic and norms stay float32. Not
float32-exact, so the tolerance is stated here. `--dtype float32` stays the exact mode (every exactness test
pins it or the default)."""

from __future__ import annotations

import statistics

import pytest
import torch
from conftest import agreeing_logprob_diffs, packed_layer

from pagellm.kernels import int8_tiles
from pagellm.model.layers.linear import Linear
from pagellm.platforms import get_platform
from pagellm.platforms.base import OpChoices

# Measured on SmolLM2 Q4_1 (27 prompts x 24 greedy tokens, 24 of them in one batch, on a Zen 5 VM;
# `benchmarks/dtype_auto_quality.py` prints these):
# chosen-token logprob differences median 0.015, p90 0.054, max 0.17 nats while the outputs agree; 11 of 27
# sequences parted, each where float32's top-1 led by 0.003-0.12 nats. On the Xeon VM (AMX) with the float16
# KV cache: median 0.003-0.008, p90 0.011-0.031, max 0.043-0.122, 3-6 of 27 parted at margins <= 0.048; with the
# int8 KV cache that auto chooses there now: median 0.011-0.014, p90 0.046-0.056, max 0.111-0.152, 10-11 of 27
# parted at margins 0.007-0.22 (nineteenth session; 4 at once / all at once).
# One-plane int8 prompt rows (OpChoices.int8_many_rows: AVX-512 BF16 + VNNI without AMX), all 27 at once on the Zen 4
# VM: median 0.019, p90 0.070, max 0.255 nats, 16 of 27 parted at margins 0.005-0.209 (4 at once: median 0.016, max
# 0.276, 15 at <= 0.172); with PAGELLM_CPU_INT8_PREFILL=0 (oneDNN bf16) median 0.014, p90 0.057, max 0.138, 12 of 27
# at <= 0.127 (thirty-eighth session, `benchmarks/dtype_auto_quality.py "auto, max_num_seqs"`). With the logits head on
# one-plane int8 too (OpChoices.int8_head, the same CPUs): median 0.023, p90 0.081, max 0.263, 15 of 27 parted at
# <= 0.209 (4 at once: median 0.022, max 0.310, 14 at <= 0.172); PAGELLM_CPU_INT8_HEAD=0 gives the figures before it
# (thirty-ninth session). The same prompts behind an instruction (`dtype_auto_quality.py --long`, the test below:
# every prompt past 20 tokens), Zen 4 VM: median 0.009, p90 0.063, max 0.360, 12 of 27 parted at <= 0.204 (4 at once:
# 0.006 / 0.062 / 0.275, 13 at <= 0.171); capped to AVX2 (one-plane int8 prompt rows over q4_1 blocks, float32 decode,
# float16 KV): median 0.005, p90 0.037, max 0.173, 7 of 27 parted at <= 0.171, against 0.000 / 0.001 / 0.003 and none
# parted with PAGELLM_CPU_INT8_PREFILL=0 (forty-first session).
AUTO_LOGPROB_MEDIAN_TOL = 0.05  # nats
AUTO_LOGPROB_TOL = 0.5  # nats, any single chosen token
AUTO_WIDE_MARGIN = 0.3  # nats between float32's top-1 and top-2: such a top-1 must survive bf16 rounding


def test_platform_chooses_bf16_gemms_only_for_auto():
    p = get_platform("cpu")
    assert not p.op_choices(torch.float32).bf16_gemm  # an explicit float32 stays exact
    assert p.op_choices(torch.float32, auto=True).bf16_gemm == p.bf16_dot_products
    assert not p.op_choices(torch.bfloat16, auto=True).bf16_gemm
    assert p.bf16_dot_products == ("avx512_bf16" in p.isa or "amx_bf16" in p.isa)


def test_platform_chooses_fine_int8_activations_only_for_auto_with_avx512_vnni():
    """Two-plane int8 activations in few-row products: the platform's choice under auto where the kernel build
    has them; an explicit --int8-activations (llama.cpp's one-plane scheme) / --no-int8-activations wins; an
    explicit dtype stays exact."""
    from pagellm.kernels import ops
    from pagellm.kernels.build import build_info

    p = get_platform("cpu")
    # where the compiler targets AVX-512 F/BW/VNNI (what `-march` gave the kernels, not the path bits)
    build = build_info() if p.native_kernels else None
    assert p.fine_int8_activations == (build is not None and {"avx512f", "avx512bw", "avx512vnni"} <= set(build["isa"]))
    assert p.fine_int8_activations == ops.has_fine_int8_activations()
    auto = p.op_choices(torch.float32, auto=True).int8_activations
    assert auto == (ops.INT8_FINE if p.fine_int8_activations else ops.INT8_OFF)
    assert p.op_choices(torch.float32).int8_activations == ops.INT8_OFF
    assert p.op_choices(torch.float32, False, auto=True).int8_activations == ops.INT8_OFF
    assert p.op_choices(torch.float32, True, auto=True).int8_activations == (ops.INT8 if p.native_kernels else 0)
    assert ("two-plane int8" in p.describe()["dtype"]) == p.fine_int8_activations
    # int8 few-row products read 0.6 bytes per weight: they keep steps up to a higher row count from bf16
    import pagellm.platforms.cpu as cpu

    # (where many-row products run on AMX tiles, those beat the packed kernels from a few rows either way)
    if p.bf16_dot_products and p.native_kernels and p.amx_tiles:
        assert p.op_choices(torch.float32, False, auto=True).packed_max_rows == cpu.AMX_PACKED_MAX_ROWS
        assert p.op_choices(torch.float32, True, auto=True).packed_max_rows == cpu.AMX_INT8_PACKED_MAX_ROWS
    elif p.bf16_dot_products and p.native_kernels:
        assert p.op_choices(torch.float32, False, auto=True).packed_max_rows == cpu.BF16_PACKED_MAX_ROWS
        assert p.op_choices(torch.float32, True, auto=True).packed_max_rows == cpu.INT8_PACKED_MAX_ROWS
    # without bf16 products (AVX-512 VNNI only: Cascade Lake, Ice Lake) the two-plane products take every row
    assert p.op_choices(torch.float32, auto=True).int8_all_rows == (
        p.fine_int8_activations and not p.bf16_dot_products)
    assert not p.op_choices(torch.float32, True, auto=True).int8_all_rows  # one plane: few rows only
    assert not p.op_choices(torch.float32).int8_all_rows  # the exact mode
    assert ("every product of q4_1/q8_0" in p.describe()["dtype"]) == (
        p.fine_int8_activations and not p.bf16_dot_products)


def test_platform_chooses_one_plane_int8_prompt_rows_under_auto_past_vdpbf16ps_or_on_avx2(monkeypatch):
    """Prompt rows run on one-plane int8 where auto chose two-plane int8 for few rows
    and vdpbf16ps for the rows above them (AVX-512 BF16 and VNNI, no AMX), and in an AVX2 build (no bf16, no VNNI:
    vpmaddubsw over q4_1 blocks, float32 elsewhere); not under an explicit dtype, an explicit
    --int8-activations / --no-int8-activations, or PAGELLM_CPU_INT8_PREFILL=0."""
    from pagellm.kernels import ops

    p = get_platform("cpu")
    auto = p.op_choices(torch.float32, auto=True)
    wanted = auto.int8_activations == ops.INT8_FINE and auto.bf16_gemm and not auto.amx_on_tiles and \
        auto.amx_max_rows > 0
    avx2 = auto.native_ops and not auto.bf16_gemm and not auto.int8_activations and int8_tiles.avx2_rows()
    assert auto.int8_many_rows == (wanted or avx2)
    wanted = wanted or avx2
    assert ("one-plane int8" in p.describe()["dtype"]) == wanted
    assert not p.op_choices(torch.float32).int8_many_rows
    assert not p.op_choices(torch.float32, False, auto=True).int8_many_rows
    assert not p.op_choices(torch.float32, True, auto=True).int8_many_rows
    monkeypatch.setenv("PAGELLM_CPU_INT8_PREFILL", "0")
    assert not p.op_choices(torch.float32, auto=True).int8_many_rows
    monkeypatch.setenv("PAGELLM_CPU_INT8_PREFILL", "yes")
    with pytest.raises(ValueError, match="PAGELLM_CPU_INT8_PREFILL"):
        p.op_choices(torch.float32, auto=True)


@pytest.mark.skipif(not get_platform("cpu").fine_int8_activations, reason="no AVX-512 VNNI int8 path in this build")
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@torch.no_grad()
def test_int8_many_rows_keep_no_bf16_copy_and_take_float32_rows(kind):
    """With OpChoices.int8_many_rows a layer keeps no bf16 copy; in a forward of prompt chunks (prompt_step) a
    product of any row count is one-plane int8_tiles.linear (bf16 x widened), returns float32, and its norm is
    not asked for bf16 rows; elsewhere (decode rows) few rows stay two-plane and more take vdpbf16ps."""
    from dataclasses import replace

    from test_amx import random_q4_1, random_q8_0

    from pagellm.kernels import amx, ops
    from pagellm.quant.linear_method import prompt_step

    w = (random_q4_1 if kind == "q4_1" else random_q8_0)(64, 96)
    choices = OpChoices(native_ops=True, packed_kernels=True, int8_activations=ops.INT8_FINE, bf16_gemm=True,
                        packed_max_rows=12, amx_max_rows=64, amx_on_tiles=False, int8_many_rows=True)
    layers = {many: packed_layer(w, replace(choices, int8_many_rows=many)) for many in (True, False)}
    layer = layers[True]
    assert layer.weight_bf16 is None and layer.int8_tiles is not None and layers[False].weight_bf16 is not None
    x = torch.randn(100, 96)
    gate_up = torch.randn(100, 192) * 3
    with prompt_step(True):
        for rows in (100, 5):
            y = layer(x[:rows])
            assert y.dtype == torch.float32 and torch.equal(y, int8_tiles.linear(x[:rows], layer.int8_tiles, ops.INT8))
        xb = x.bfloat16()
        assert torch.equal(layer(xb), int8_tiles.linear(xb.float(), layer.int8_tiles, ops.INT8))
        assert not layer.rounds_input_to_bf16(100) and layers[False].rounds_input_to_bf16(100)
        # as an MLP's down projection: the activation inside the rounding, the bits of ops.silu_mul then the product
        assert torch.equal(layer.silu_mul_forward(gate_up), layer(ops.silu_mul(gate_up)))
        assert layers[False].silu_mul_forward(gate_up) is None
    assert torch.equal(layer(x[:5]), int8_tiles.linear(x[:5], layer.int8_tiles, ops.INT8_FINE))
    assert layer.silu_mul_forward(gate_up) is None and layer.rounds_input_to_bf16(100)
    if amx.bf16dp_ready():  # decode rows past the few-row kernels: vdpbf16ps at any count, no bf16 copy needed
        assert torch.equal(layer(x), amx.linear(x, layer.amx_blocks, torch.float32, tiles=False))
    # a tensor-parallel cut the tile orders cannot take (24 columns) gets its bf16 copy back for those rows
    layer.shard(rows=torch.arange(8, 32))
    assert layer.int8_tiles is None and layer.weight_bf16 is not None and layer.rounds_input_to_bf16(100)
    ref = x @ w.dequantize()[8:32].t()
    with prompt_step(True):
        assert (layer(x) - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_platform_multiplies_the_logits_head_on_one_plane_int8_where_prompt_rows_are(monkeypatch):
    """The logits head's rows run on one-plane int8 on the CPUs whose prompt rows do (not with another dtype or an
    explicit --int8-activations choice); PAGELLM_CPU_INT8_HEAD=0 switches the head alone back."""
    for name in ("PAGELLM_CPU_INT8_PREFILL", "PAGELLM_CPU_INT8_HEAD"):
        monkeypatch.delenv(name, raising=False)
    p = get_platform("cpu")
    auto = p.op_choices(torch.float32, auto=True)
    assert auto.int8_head == (auto.int8_many_rows and auto.bf16_gemm)  # AVX2: prompt rows only
    assert ("logits head" in p.describe()["dtype"]) == auto.int8_head
    assert not p.op_choices(torch.float32).int8_head
    assert not p.op_choices(torch.float32, False, auto=True).int8_head
    assert not p.op_choices(torch.float32, True, auto=True).int8_head
    monkeypatch.setenv("PAGELLM_CPU_INT8_HEAD", "0")
    assert not p.op_choices(torch.float32, auto=True).int8_head
    assert p.op_choices(torch.float32, auto=True).int8_many_rows == auto.int8_many_rows
    monkeypatch.setenv("PAGELLM_CPU_INT8_HEAD", "2")
    with pytest.raises(ValueError, match="PAGELLM_CPU_INT8_HEAD"):
        p.op_choices(torch.float32, auto=True)


@pytest.mark.skipif(not get_platform("cpu").fine_int8_activations, reason="no AVX-512 VNNI int8 path in this build")
@torch.no_grad()
def test_int8_logits_head_takes_one_plane_past_the_few_row_kernels():
    """With OpChoices.int8_head the logits head (Linear.logits_head) keeps neither a bf16 copy nor AMX tile-order
    blocks; past the few-row kernels' rows it multiplies on one-plane int8 (a row's bits the same among 13 or 100
    rows: the few-row and the wide kernels agree); few rows stay two-plane, as the layers' (the model runner
    counts a batch's size there). Other layers, and the head without the choice, keep their paths; a tensor-parallel
    cut that the int8 tile order cannot take gets the bf16 copy back."""
    from dataclasses import replace

    from test_amx import random_q8_0

    from pagellm.kernels import amx, ops

    w = random_q8_0(64, 96)
    choices = OpChoices(native_ops=True, packed_kernels=True, int8_activations=ops.INT8_FINE, bf16_gemm=True,
                        packed_max_rows=12, amx_max_rows=64, amx_on_tiles=False, int8_many_rows=True, int8_head=True)
    layers = {}
    for name, head, on in (("head", True, True), ("layer", False, True), ("head off", True, False)):
        layers[name] = packed_layer(w, replace(choices, int8_head=on), logits_head=head)
    head = layers["head"]
    assert head.weight_bf16 is None and head.amx_blocks is None and head.int8_tiles is not None
    assert layers["layer"].amx_blocks is not None and layers["head off"].amx_blocks is not None
    x = torch.randn(100, 96)
    one = int8_tiles.linear(x, head.int8_tiles, ops.INT8)
    for rows in (13, 100):
        y = head(x[:rows])
        assert y.dtype == torch.float32 and torch.equal(y, one[:rows]) and not head.rounds_input_to_bf16(rows)
    few = int8_tiles.linear(x[:5], head.int8_tiles, ops.INT8_FINE)
    assert torch.equal(head(x[:5]), few) and torch.equal(layers["head off"](x[:5]), few)
    assert not torch.equal(few, one[:5])
    if amx.bf16dp_ready():  # past the few-row kernels the others take vdpbf16ps
        assert not torch.equal(layers["head off"](x), one) and not torch.equal(layers["layer"](x), one)
    head.shard(rows=torch.arange(8, 32))
    assert head.int8_tiles is None and head.weight_bf16 is not None
    ref = x @ w.dequantize()[8:32].t()
    assert (head(x) - ref).abs().max() <= 2e-2 * ref.abs().max()


@pytest.mark.skipif(not get_platform("cpu").fine_int8_activations, reason="no AVX-512 VNNI int8 path in this build")
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@torch.no_grad()
def test_int8_all_rows_runs_many_row_products_on_the_int8_tiles(kind):
    """With OpChoices.int8_all_rows a layer with int8 tile-order blocks computes every row count there (the bits of
    int8_tiles.linear, a row's the same in any call); without it, many rows take the float32 product."""
    from test_amx import random_q4_1, random_q8_0

    from pagellm.kernels import ops
    from pagellm.quant.linear_method import GGUFBlocksLinearMethod

    w = (random_q4_1 if kind == "q4_1" else random_q8_0)(64, 96)
    x = torch.randn(300, 96)
    outs = {}
    for all_rows in (False, True):
        choices = OpChoices(native_ops=True, packed_kernels=True, int8_activations=ops.INT8_FINE,
                            int8_all_rows=all_rows)
        layer = packed_layer(w, choices)
        assert isinstance(layer.quant_method, GGUFBlocksLinearMethod) and layer.int8_tiles is not None
        outs[all_rows] = layer(x)
        if all_rows:
            assert torch.equal(outs[True], int8_tiles.linear(x, layer.int8_tiles, ops.INT8_FINE))
            assert torch.equal(layer(x[7:9]), outs[True][7:9])
    ref = x @ w.dequantize().t()
    assert not torch.equal(outs[False], outs[True])  # float32 there
    scale = (x.abs() @ w.dequantize().abs().t()).max()
    assert (outs[True] - ref).abs().max() <= 1e-4 * scale and (outs[False] - ref).abs().max() <= 1e-5 * scale


def test_auto_kv_cache_is_16_or_8_bits_where_kernels_read_it(monkeypatch, tiny_hf_model, smollm_gguf_path):
    from pagellm import LLM
    from pagellm.kernels import ops

    p = get_platform("cpu")
    reads_f16 = p.kv_dtype_readable_natively(torch.float16)
    reads_i8 = p.kv_dtype_readable_natively(torch.int8) and ops.has_bf16_prefill_attention()
    monkeypatch.setattr(p, "isa", [f for f in p.isa if f not in ("avx512_bf16", "amx_bf16")])
    # an AVX2 machine: llama.cpp's f16 cache where the paged kernel reads it (F16C), float32 activations
    assert p.auto_kv_dtype(torch.float32) == (torch.float16 if reads_f16 else torch.float32)
    masked = p.op_choices(torch.float32, auto=True)  # and its float32 few-row limit, without bf16 copies
    assert not masked.bf16_gemm and not masked.bf16_prepacked and masked.packed_max_rows is None
    monkeypatch.setattr(p, "isa", [*p.isa, "avx512_bf16"])
    assert p.auto_kv_dtype(torch.float32) == (torch.int8 if reads_i8 else torch.float16 if reads_f16 else torch.float32)
    monkeypatch.setattr(ops, "has_bf16_prefill_attention", lambda: False)  # int8 prefills would take float32 SDPA
    assert p.auto_kv_dtype(torch.float32) == (torch.float16 if reads_f16 else torch.float32)
    monkeypatch.undo()
    path, kw = tiny_hf_model(), {"tokenizer": smollm_gguf_path, "kv_cache_memory": "4MiB"}
    auto = LLM(path, dtype="auto", **kw).engine
    assert auto.kv_dtype == p.auto_kv_dtype(torch.float32)
    assert auto.runner.kv_caches[0].dtype == auto.kv_dtype
    assert LLM(path, dtype="auto", kv_cache_dtype="float32", **kw).engine.kv_dtype == torch.float32
    assert LLM(path, **kw).engine.kv_dtype == torch.float32  # the exact default


def test_bf16_linear_is_within_bf16_rounding_of_the_float64_product():
    """The many-row path on any CPU (torch's bf16 GEMM runs everywhere, slowly where the ISA lacks it):
    |error| <= 2^-7 sum_i |x_i w_i| (x and w each rounded to 8 significant bits) plus float32 accumulation."""
    torch.manual_seed(0)
    layer = Linear(96, 40, bias=True)
    layer.configure(OpChoices(bf16_gemm=True))
    w, b = torch.randn(40, 96), torch.randn(40)
    with torch.no_grad():  # as the loader runs
        layer.load_shard(0, w)
        layer.bias.copy_(b)
        layer.process_after_loading()
    assert layer.weight_bf16 is not None and layer.weight_bf16.dtype == torch.bfloat16
    layer.requires_grad_(False)
    x = torch.randn(32, 96)  # more rows than the few-row kernels take
    ref = x.double() @ w.double().t() + b.double()
    bound = 2.0**-7 * (x.double().abs() @ w.double().abs().t()) + 1e-5
    assert ((layer(x).double() - ref).abs() <= bound).all()
    few = layer(x[:4])  # few rows stay float32
    torch.testing.assert_close(few, (x[:4] @ w.t() + b), rtol=1e-5, atol=1e-5)


# oneDNN reorders bf16 weights only on a CPU with AVX-512 BW/VL/DQ or AVX-NE-CONVERT: the platform prepacks where it
# has bf16 dot products (platforms/cpu.py op_choices), never on an AVX2-only CPU
@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not get_platform("cpu").bf16_dot_products,
                    reason="torch built without oneDNN, or a CPU whose platform does not prepack bf16 weights")
def test_prepacked_bf16_weights_give_the_plain_products_bit_for_bit():
    torch.manual_seed(0)
    w, x = torch.randn(40, 96), torch.randn(32, 96)
    layers = []
    for prepacked in (False, True):
        layer = Linear(96, 40)
        layer.configure(OpChoices(bf16_gemm=True, bf16_prepacked=prepacked))
        with torch.no_grad():
            layer.load_shard(0, w)
            layer.process_after_loading()
        layer.requires_grad_(False)
        layers.append(layer)
    plain, packed = layers
    # reordered at load, not by the first product (which made a server's first big step ~150-300 ms slower)
    assert packed.weight_bf16.is_mkldnn and not plain.weight_bf16.is_mkldnn
    assert torch.equal(plain(x), packed(x))
    packed.bf16_out = plain.bf16_out = True
    assert packed(x).dtype == torch.bfloat16 and torch.equal(plain(x), packed(x))
    packed.shard(rows=torch.arange(8, 24))  # a cut after the reorder starts from the plain values again
    assert packed.weight_bf16.is_mkldnn  # and is reordered at once
    assert torch.equal(packed(x), plain(x)[:, 8:24])


BATCH_PROMPTS = [f"Item {i}: the capital of country number {i} in a long list of countries is" for i in range(24)]
BATCH_PROMPTS += ["The three primary colors are", "def add(a, b):\n    return", "Water boils at a temperature of"]
# benchmarks/dtype_auto_quality.py's --long prefix
LONG_PROMPT_PREFIX = "Answer each of the following questions about geography, science or code briefly and correctly.\n"


@pytest.mark.slow
def test_dtype_auto_stays_close_to_float32(smollm_gguf_path):
    from pagellm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    # the bf16 GEMMs' bounds: few-row steps (int8 activations where the platform chose them) and one-plane int8
    # prefill are tested below
    auto = LLM(smollm_gguf_path, dtype="auto", int8_activations=False)
    bf16 = auto.engine.model.layers[0].mlp.down_proj.weight_bf16 is not None
    assert bf16 == get_platform("cpu").op_choices(torch.float32, auto=True).bf16_gemm
    # no bf16 dot products here: auto computes in float32 with a float16 KV cache where the kernels read it (as
    # llama.cpp's default), so float32 with that cache is exact
    exact = LLM(smollm_gguf_path, dtype="float32",
                kv_cache_dtype="float32" if bf16 else str(auto.engine.kv_dtype).removeprefix("torch."))
    a = exact.generate(BATCH_PROMPTS, params, use_tqdm=False)
    b = auto.generate(BATCH_PROMPTS, params, use_tqdm=False)
    if not bf16:
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
        return
    diffs = agreeing_logprob_diffs([o.outputs[0] for o in a], [o.outputs[0] for o in b], AUTO_WIDE_MARGIN)
    assert len(diffs) >= 100
    assert statistics.median(diffs) < AUTO_LOGPROB_MEDIAN_TOL and max(diffs) < AUTO_LOGPROB_TOL


@pytest.mark.slow
def test_one_plane_int8_prefill_stays_within_the_same_bounds(smollm_gguf_path):
    """Where the platform runs prefill on one-plane int8 (the 27 prompts in one step of ~900 rows; decode steps
    of 27 rows on vdpbf16ps, few-row ones on two planes; the logits head past them on one plane; on AVX2 decode
    steps in float32), the bounds above hold. Its tail is about twice the bf16 GEMMs' (the figures at the top).
    The prompts sit behind an instruction that takes each past every platform's few-row limit (on AVX2, 20
    tokens: shorter prompts take the few-row float32 kernels there)."""
    from pagellm import LLM, SamplingParams

    if not get_platform("cpu").op_choices(torch.float32, auto=True).int8_many_rows:
        pytest.skip("prefill is not one-plane int8 here (it is on AVX2, and where AVX-512 BF16 and VNNI meet "
                    "without AMX)")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    exact, auto = LLM(smollm_gguf_path, dtype="float32"), LLM(smollm_gguf_path, dtype="auto")
    layer = auto.engine.model.layers[0].mlp.down_proj
    assert layer.weight_bf16 is None and layer.int8_tiles is not None
    prompts = [LONG_PROMPT_PREFIX + p for p in BATCH_PROMPTS]
    assert min(len(auto.get_tokenizer().encode(p)) for p in prompts) > 20
    a = exact.generate(prompts, params, use_tqdm=False)
    b = auto.generate(prompts, params, use_tqdm=False)
    diffs = agreeing_logprob_diffs([o.outputs[0] for o in a], [o.outputs[0] for o in b], AUTO_WIDE_MARGIN)
    assert len(diffs) >= 100
    assert statistics.median(diffs) < AUTO_LOGPROB_MEDIAN_TOL and max(diffs) < AUTO_LOGPROB_TOL


@pytest.mark.slow
def test_dtype_auto_single_stream_stays_close_to_float32(smollm_gguf_path):
    """One request at a time under auto: prefill (prompts of under 64 tokens here) takes the bf16 products, decode
    steps of one row the few-row kernels, with two-plane int8 activations where the platform chose them: the bf16
    bounds above hold (the second plane keeps the products at float32 level; one-plane int8 would not:
    tests/test_kernels.py)."""
    from pagellm import LLM, SamplingParams
    from pagellm.kernels import ops

    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    # Six prompts: greedy runs part at near-ties, and where depends on the CPU's summation order (on an AMX Xeon
    # the first three parted after 8, 20 and 21 tokens, 49 compared positions), so the count below needs headroom.
    prompts = ["The three primary colors are", "def add(a, b):\n    return", "Water boils at a temperature of",
               "The capital of France is", "Once upon a time, in a small village,",
               "import numpy as np\n\ndef mean(x):\n   "]
    exact, auto = LLM(smollm_gguf_path, dtype="float32"), LLM(smollm_gguf_path, dtype="auto")
    mode = auto.engine.model.layers[0].mlp.down_proj.int8_activations
    assert mode == (ops.INT8_FINE if get_platform("cpu").fine_int8_activations else ops.INT8_OFF)
    one_by_one = [(exact.generate([p], params, use_tqdm=False)[0].outputs[0],
                   auto.generate([p], params, use_tqdm=False)[0].outputs[0]) for p in prompts]
    diffs = agreeing_logprob_diffs(*zip(*one_by_one, strict=True), AUTO_WIDE_MARGIN)
    assert len(diffs) >= 80  # of 240 (145 on that Xeon)
    assert statistics.median(diffs) < AUTO_LOGPROB_MEDIAN_TOL and max(diffs) < AUTO_LOGPROB_TOL


@pytest.mark.slow
def test_norms_hand_bf16_products_bf16_rows_without_changing_a_bit(smollm_gguf_path, monkeypatch):
    """Under auto the norms round their output to bf16 for products that would round it themselves
    (ops.rmsnorm_to_bf16 in prefill steps): the same prompt logprobs and tokens as with that hint off."""
    from pagellm import LLM, SamplingParams
    from pagellm.kernels import ops

    monkeypatch.setenv("PAGELLM_CPU_INT8_PREFILL", "0")  # where prefill would be one-plane int8: the bf16 products
    llm = LLM(smollm_gguf_path, dtype="auto", enable_prefix_caching=False)
    if llm.engine.model.layers[0].self_attn.qkv_proj.weight_bf16 is None:
        pytest.skip("no bf16 products here (no AVX-512 BF16 or AMX): the norms stay float32")
    calls, fused = [], ops.rmsnorm_to_bf16
    monkeypatch.setattr(ops, "rmsnorm_to_bf16", lambda *args: calls.append(1) or fused(*args))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    prompts = [[(37 * i + 11 * j) % 9000 + 5 for j in range(120 + 90 * i)] for i in range(4)]

    def run():
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs)
                for o in llm.generate(prompts, params, use_tqdm=False)]

    with_hint = run()
    assert len(calls) >= 2 * len(llm.engine.model.layers)
    monkeypatch.setattr(Linear, "rounds_input_to_bf16", lambda self, rows: False)
    calls.clear()
    without = run()
    assert not calls and with_hint == without
