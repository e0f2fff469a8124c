"""Few-row int8-activation products over q4_1 and q8_0 blocks in tile order (pagellm/kernels/int8_tiles.py,
cpu/quant_linear_int8_tiles.cpp): a row's result is the same bits whatever the rows in the call and whichever
unit ran it (AVX-512 VNNI or AMX-INT8), and as close to the float product as the other int8 kernels. The kernel
tests run where the build has the path (AVX-512 VNNI), the tile ones where AMX-INT8 is granted too; the
packing tests run everywhere."""

from __future__ import annotations

import pytest
import torch
from test_amx import RANDOM, random_q4_1, random_q8_0

from pagellm.kernels import int8_tiles, ops
from pagellm.quant.formats import PackedWeight

needs_path = pytest.mark.skipif(not int8_tiles.available(), reason="no AVX-512 VNNI int8 tile path in this build")
needs_tiles = pytest.mark.skipif(not int8_tiles.amx_ready(), reason="no AMX-INT8 tiles in this CPU, build or process")


def codes(w: PackedWeight) -> torch.Tensor:
    """The blocks' integer codes [N, K] in input order."""
    if w.kind == "q8_0":
        return w.qs.to(torch.int32)
    q = w.qs.reshape(w.out_features, -1, 16)
    return torch.cat([q & 15, q >> 4], dim=2).reshape(w.out_features, -1).to(torch.int32)


def unpack(t: int8_tiles.Int8Tiles) -> torch.Tensor:
    """The layout read back independently of the packer: code of (column n, input k) from its tile byte."""
    n, k = t.out_features, t.in_features
    out = torch.empty(n, k, dtype=torch.int32)
    raw = t.codes.to(torch.int32)
    for col in range(n):
        s, c = divmod(col, 16)
        for kk in range(k):
            b, j, i = kk // 32, kk % 32 // 4, kk % 4
            if t.kind == "q8_0":
                out[col, kk] = raw[s, b, j, 4 * c + i] - 128
            else:
                byte = raw[s, b, j % 4, 4 * c + i]
                out[col, kk] = byte & 15 if j < 4 else byte >> 4
    return out


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_pack_puts_each_code_in_its_tile_byte_with_scales_per_strip(kind):
    w = RANDOM[kind](32, 64, seed=3)
    t = int8_tiles.pack(w)
    assert t.codes.shape == (2, 2, 4 if kind == "q4_1" else 8, 64) and t.codes.dtype == torch.uint8
    assert torch.equal(unpack(t), codes(w))
    assert torch.equal(t.d[1, 0], w.d[16:32, 0])  # strip 1, block 0: columns 16..31's scales
    if kind == "q4_1":
        assert torch.equal(t.m[0, 1], w.m[:16, 1])


def test_packs_only_q4_1_and_q8_0_in_natural_order_with_whole_strips():
    assert int8_tiles.packs(random_q4_1(16, 32)) and int8_tiles.packs(random_q8_0(48, 64))
    assert not int8_tiles.packs(random_q4_1(24, 64))  # N not a multiple of 16
    w = random_q4_1(16, 64)
    w.perm = torch.arange(64)
    assert not int8_tiles.packs(w)
    with pytest.raises(ValueError, match="no tile order"):
        int8_tiles.pack(w)


def reference(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    return x.double() @ w.dequantize().double().t()


@needs_path
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("planes", [1, 2])
def test_a_row_gives_the_same_bits_in_any_call_and_stays_near_the_float_product(kind, planes):
    torch.manual_seed(planes)
    w = RANDOM[kind](96, 576, seed=1)
    t = int8_tiles.pack(w)
    x = torch.randn(37, 576)
    alone = torch.cat([int8_tiles.linear(x[i:i + 1], t, planes) for i in range(37)])
    # both sides of the VNNI / tile limit (24 / 25), partial tiles; the VNNI passes of 1-12 rows (13 = 6 + 7)
    for rows in (2, 5, 6, 7, 9, 10, 11, 12, 13, 17, 24, 25, 37):
        assert torch.equal(int8_tiles.linear(x[:rows], t, planes), alone[:rows]), rows
    assert torch.equal(int8_tiles.linear(x, t, planes, "vnni"), alone)
    ref = reference(x, w)
    err = ((alone.double() - ref).abs().max() / ref.abs().max()).item()
    # one plane: x's int8 rounding (llama.cpp's scheme); two: ~15 bits, float32-level (test_kernels.py's bounds)
    assert err < (2e-2 if planes == 1 else 2e-4)
    old = ops.packed_linear(x, w, planes)  # the natural-order VNNI kernel rounds x the same way
    assert ((alone - old).abs().max() / ref.abs().max()).item() < (1e-5 if planes == 2 else 1e-4)


@needs_path
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("shape", [(80, 576), (96, 1536)])
def test_many_rows_give_the_same_bits_as_few_row_calls(kind, shape):
    """From 48 rows on AVX-512 VNNI, one plane, the wide kernel (cpu/quant_linear_int8_wide.cpp: 6 rows x 2 strips
    a tile, rows in equal chunks of up to 240, x rounded in parallel) runs; a row's bits are those of a call of a
    few rows. 80 columns: two strip pairs and a strip alone; row counts at the 48-row limit, the tiles' remainders
    of 1-5 rows and the chunk edges."""
    torch.manual_seed(7)
    n, k = shape
    t = int8_tiles.pack(RANDOM[kind](n, k, seed=4))
    x = torch.randn(490, k) * 2
    few = torch.cat([int8_tiles.linear(x[i:i + 10], t, 1, "vnni") for i in range(0, 490, 10)])
    for rows in (47, 48, 49, 52, 53, 59, 239, 240, 241, 490):
        assert torch.equal(int8_tiles.linear(x[:rows], t, 1, "vnni"), few[:rows]), rows
    assert torch.equal(int8_tiles.linear(x[3:300], t, 1, "vnni"), few[3:300])  # strided start, a chunk and a bit


@needs_path
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("planes", [1, 2])
def test_silu_mul_inside_the_rounding_gives_the_bits_of_silu_mul_then_the_product(kind, planes):
    """silu_mul=True takes an MLP's gate/up output and computes silu(gate) * up as ops.silu_mul does while x is
    rounded: the same bits as the two passes, few rows or many."""
    torch.manual_seed(9)
    t = int8_tiles.pack(RANDOM[kind](48, 576, seed=6))
    for rows in (3, 48, 301):
        gate_up = torch.randn(rows, 1152) * 4
        fused = int8_tiles.linear(gate_up, t, planes, silu_mul=True)
        assert torch.equal(fused, int8_tiles.linear(ops.silu_mul(gate_up), t, planes)), rows
    with pytest.raises(ValueError, match="gate and up"):
        int8_tiles.linear(torch.randn(4, 576), t, 1, silu_mul=True)


@needs_tiles
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_tiles_and_vnni_give_the_same_bits(kind):
    torch.manual_seed(5)
    w = RANDOM[kind](64, 1536, seed=2)
    t = int8_tiles.pack(w)
    for rows in (1, 3, 16, 20, 70):  # 70: the wide VNNI kernel against the tiles
        x = torch.randn(rows, 1536) * 3
        for planes in (1, 2):
            assert torch.equal(int8_tiles.linear(x, t, planes, "tiles"), int8_tiles.linear(x, t, planes, "vnni"))


@needs_path
def test_bad_shapes_are_refused_not_computed():
    t = int8_tiles.pack(random_q4_1(16, 64))
    with pytest.raises(ValueError, match="columns"):
        int8_tiles.linear(torch.randn(2, 32), t, 2)
    assert int8_tiles.linear(torch.randn(0, 64), t, 2).shape == (0, 16)


needs_avx2 = pytest.mark.skipif(not int8_tiles.avx2_rows(), reason="not an AVX2 build (the AVX-512 paths above run)")


@needs_avx2
@pytest.mark.parametrize("shape", [(80, 576), (96, 1536)])
def test_avx2_prompt_rows_give_a_rows_bits_in_any_call_near_the_float_product(shape):
    """An AVX2 build's one-plane products over q4_1 blocks (cpu/quant_linear_int8_avx2.cpp: vpmaddubsw, int16 sums per
    block): a row's bits whatever the rows beside it (tiles of 3 rows, chunks of up to 240), x rounded as the
    natural-order one-plane kernel rounds it, and the float product within int8 rounding."""
    torch.manual_seed(11)
    n, k = shape
    w = random_q4_1(n, k, seed=8)
    t = int8_tiles.pack(w)
    x = torch.randn(490, k) * 2
    alone = torch.cat([int8_tiles.linear(x[i:i + 1], t, 1) for i in range(0, 490)])
    for rows in (2, 3, 4, 5, 239, 240, 241, 490):
        assert torch.equal(int8_tiles.linear(x[:rows], t, 1), alone[:rows]), rows
    assert torch.equal(int8_tiles.linear(x[3:300], t, 1), alone[3:300])
    ref = reference(x, w)
    assert ((alone.double() - ref).abs().max() / ref.abs().max()).item() < 2e-2
    old = ops.packed_linear(x, w, ops.INT8)  # the few-row one-plane kernel rounds x the same way
    assert ((alone - old).abs().max() / ref.abs().max()).item() < 1e-4


@needs_avx2
def test_avx2_prompt_rows_fuse_silu_mul_and_refuse_what_they_do_not_compute():
    torch.manual_seed(9)
    t = int8_tiles.pack(random_q4_1(48, 576, seed=6))
    for rows in (3, 301):
        gate_up = torch.randn(rows, 1152) * 4
        fused = int8_tiles.linear(gate_up, t, 1, silu_mul=True)
        assert torch.equal(fused, int8_tiles.linear(ops.silu_mul(gate_up), t, 1))
    x = torch.randn(4, 576)
    with pytest.raises(RuntimeError, match="cannot run"):  # two planes: the AVX-512 VNNI builds only
        int8_tiles.linear(x, t, 2)
    with pytest.raises(RuntimeError, match="cannot run"):  # q8_0's codes + 128 would overflow vpmaddubsw's pairs
        int8_tiles.linear(x, int8_tiles.pack(random_q8_0(48, 576)), 1)


@needs_path
def test_the_avx2_build_gives_the_avx512_wide_kernels_bits(tmp_path):
    """The AVX2 prompt-row kernel's float work is int8_tile_rows.h's accumulate lane for lane over the same exact
    integer sums, so an AVX2 build (PAGELLM_CPU_ISA=avx2, in a subprocess: one build per process) gives the bits of
    this AVX-512 build's one-plane products."""
    import os
    import subprocess
    import sys

    torch.manual_seed(13)
    t = int8_tiles.pack(random_q4_1(64, 1536, seed=12))
    x = torch.randn(70, 1536) * 3
    torch.save({"t": t.codes, "d": t.d, "m": t.m, "x": x}, tmp_path / "in.pt")
    script = (
        "import sys, torch\n"
        "from pagellm.kernels import int8_tiles\n"
        "assert int8_tiles.avx2_rows()\n"
        f"a = torch.load({str(tmp_path / 'in.pt')!r})\n"
        "t = int8_tiles.Int8Tiles('q4_1', a['t'], a['d'], a['m'], 64, 1536)\n"
        f"torch.save(int8_tiles.linear(a['x'], t, 1), {str(tmp_path / 'out.pt')!r})\n")
    env = dict(os.environ, PAGELLM_CPU_ISA="avx2")
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=240)
    assert torch.equal(torch.load(tmp_path / "out.pt"), int8_tiles.linear(x, t, 1))


@needs_avx2
@torch.no_grad()
def test_avx2_int8_many_rows_take_q4_1_prompt_rows_only():
    """In an AVX2 build (OpChoices.int8_many_rows without bf16 GEMMs) a q4_1 layer keeps its blocks in int8 tile
    order too; in a forward of prompt chunks a product of any row count is one-plane int8_tiles.linear (the MLP's
    activation inside the rounding), elsewhere the float32 paths as without the choice. A q8_0 layer keeps its
    float32 paths everywhere (the kernel takes q4_1 only)."""
    from dataclasses import replace

    from conftest import packed_layer

    from pagellm.platforms.base import OpChoices
    from pagellm.quant.linear_method import prompt_step

    choices = OpChoices(native_ops=True, packed_kernels=True, blas_gemm=True, packed_weights_only=True,
                        int8_many_rows=True)
    x, gate_up = torch.randn(100, 96), torch.randn(100, 192) * 3
    for kind, w in (("q4_1", random_q4_1(64, 96)), ("q8_0", random_q8_0(64, 96))):
        layer, plain = (packed_layer(w, replace(choices, int8_many_rows=many)) for many in (True, False))
        assert (layer.int8_tiles is not None) == (kind == "q4_1") and plain.int8_tiles is None
        for rows in (100, 5, 1):
            assert torch.equal(layer(x[:rows]), plain(x[:rows]))  # decode rows: float32 as without the choice
            with prompt_step(True):
                y = layer(x[:rows])
                if kind == "q4_1":
                    assert torch.equal(y, int8_tiles.linear(x[:rows], layer.int8_tiles, ops.INT8)), rows
                    assert torch.equal(layer.silu_mul_forward(gate_up[:rows]), layer(ops.silu_mul(gate_up[:rows])))
                else:
                    assert torch.equal(y, plain(x[:rows])) and layer.silu_mul_forward(gate_up[:rows]) is None
        ref = x @ w.dequantize().t()
        with prompt_step(True):
            assert (layer(x) - ref).abs().max() <= 2e-2 * ref.abs().max()


@needs_avx2
def test_avx2_int8_prompt_rows_only_where_every_layer_takes_them(tmp_path):
    """On AVX2 a model whose layers do not all take the int8 prompt rows (a Q4_K_M-like mix: Q6_K pieces become
    q8_*_16 blocks, which stay float32) runs every layer on float32 (model_loader.int8_prompt_rows_in_every_layer_
    or_none): the float32 layers' row-count-dependent rounding would reach the int8 ones, which magnify it. A model
    of q4_1-packed blocks keeps them, and the runner marks its prompts."""
    from test_gguf_block_types import write_tiny_gguf

    from pagellm import LLM
    from pagellm.model.layers.linear import Linear
    from pagellm.model.loader import resolve_model_path

    tokenizer = resolve_model_path(None)
    for name, qtype, types, kept in (("mix", "Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K"}, False),
                                     ("q4_0", "Q4_0", {"output": "Q8_0"}, True)):
        path = write_tiny_gguf(str(tmp_path / f"tiny.{name}.gguf"), qtype, types=types)
        llm = LLM(path, tokenizer=tokenizer, dtype="auto", kv_cache_memory="16MiB")
        model = llm.engine.model
        layers = [m for m in model.modules() if isinstance(m, Linear) and not m.logits_head]
        assert {m.quant_method.choices.int8_many_rows for m in layers} == {kept}, name
        assert llm.engine.runner._choices.int8_many_rows == kept
        assert all((m.int8_tiles is not None) == kept for m in layers), name
        assert len(llm.generate([list(range(5, 60))], use_tqdm=False)[0].outputs[0].token_ids) > 0


def test_prompts_attend_through_the_paged_kernel_only_under_auto_without_bf16_products():
    """Marked prompt chunks take the paged kernel at any row count (CpuPagedAttention._paged_prompts) only where
    their rows are int8 without a bf16 prompt kernel (AVX2): an AVX-512 BF16 CPU with an fp8 cache, which that kernel
    does not read, keeps SDPA (2-3x faster there: a review's probe, forty-first session)."""
    from pagellm.model.attention import get_attention_backend
    from pagellm.platforms import get_platform

    platform = get_platform("cpu")
    for kv in (torch.float16, torch.float8_e4m3fn):
        if not platform.kv_dtype_readable_natively(kv):
            continue
        for auto in (True, False):
            backend = get_attention_backend("auto", platform, kv, torch.float32, auto_dtype=auto)
            assert backend.paged_prompts == (auto and not platform.bf16_dot_products), (kv, auto)
