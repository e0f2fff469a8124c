"""Many-row q4_1 and q8_0 products on AMX bf16 tiles (pagellm/kernels/amx.py, cpu/quant_linear_amx.cpp), or on
AVX-512 BF16 vdpbf16ps over the same tile-order blocks where the CPU has no AMX (cpu/quant_linear_bf16dp.cpp): the
bf16 path's arithmetic (the loader's weights and x rounded to bf16, float32 sums) over the blocks dequantized at
every product. Each kernel's tests run where the CPU and the build have it (skipped elsewhere); the platform and
packing tests run everywhere."""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels import amx
from pagellm.platforms import get_platform
from pagellm.quant.formats import PackedWeight

needs_amx = pytest.mark.skipif(not amx.amx_ready(), reason="no AMX-BF16 tiles in this CPU, build or process")
needs_bf16dp = pytest.mark.skipif(not amx.bf16dp_ready(), reason="no AVX-512 BF16 in this CPU or build")
# amx.linear's two kernels over the same blocks: tiles=True (AMX), tiles=False (vdpbf16ps)
KERNELS = [pytest.param(True, marks=needs_amx, id="amx"), pytest.param(False, marks=needs_bf16dp, id="vdpbf16ps")]
# the engine tests: the kernel the platform picks (AMX where it runs, else vdpbf16ps)
needs_tile_products = pytest.mark.skipif(not (amx.amx_ready() or amx.bf16dp_ready()),
                                         reason="neither AMX-BF16 nor AVX-512 BF16 in this CPU or build")


def random_q4_1(n: int, k: int, seed: int = 0) -> PackedWeight:
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()  # GGUF scales are float16
    m = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    return PackedWeight("q4_1", torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g), d, m)


def random_q8_0(n: int, k: int, seed: int = 0) -> PackedWeight:
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.002).half().float()
    return PackedWeight("q8_0", torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g), d, None)


RANDOM = {"q4_1": random_q4_1, "q8_0": random_q8_0}


@pytest.fixture(autouse=True)
def platform_default(monkeypatch):
    """These tests state what the platform picks by default (and switch the products off themselves): a
    PAGELLM_CPU_AMX=0 in the caller's environment would make them fail on what it asked for."""
    monkeypatch.delenv("PAGELLM_CPU_AMX", raising=False)


def bf16_reference(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """The oneDNN path's operands in float64: x and the loader's weights rounded to bf16."""
    return x.to(torch.bfloat16).double() @ w.dequantize().to(torch.bfloat16).double().t()


def test_packs_only_q4_1_and_q8_0_in_natural_order_with_whole_strips():
    assert amx.packs(random_q4_1(64, 64)) and amx.packs(random_q8_0(64, 64))
    assert not amx.packs(random_q4_1(48, 64))  # 48 columns: not whole strips of 32
    q8_1 = PackedWeight("q8_1", torch.zeros(64, 64, dtype=torch.int8), torch.ones(64, 2), torch.zeros(64, 2))
    assert not amx.packs(q8_1)
    with pytest.raises(ValueError, match="no tile order"):
        amx.pack(q8_1)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_tile_order_holds_every_code_and_scale_once(kind):
    """Unpacking the tile order by its documented layout gives back the weight's codes, scales and minimums."""
    w = RANDOM[kind](64, 96, seed=1)
    t = amx.pack(w)
    n, k = 64, 96
    width = 16 if kind == "q4_1" else 32
    assert t.codes.shape == (n // 32, k // 32, 2, 16, width) and t.d.shape == (n // 32, k // 32, 2, 16)
    if kind == "q4_1":
        lanes = torch.cat([t.codes & 15, t.codes >> 4], dim=-1)  # [strip, block, group, row r, lane L]
        q = w.qs.reshape(n, k // 32, 16)
        codes = torch.cat([q & 15, q >> 4], dim=2)  # [n, block, input]
    else:
        lanes, codes = t.codes, w.qs.reshape(n, k // 32, 32)
    for s, b, g, r, lane in [(0, 0, 0, 0, 0), (1, 2, 1, 15, 31), (0, 1, 1, 7, 16), (1, 0, 0, 3, 9)]:
        col = s * 32 + g * 16 + lane // 2
        assert lanes[s, b, g, r, lane] == codes[col, b, 2 * r + lane % 2]
        assert t.d[s, b, g, lane // 2] == w.d[col, b]
        assert (t.m is None) == (w.m is None) and (t.m is None or t.m[s, b, g, lane // 2] == w.m[col, b])


@pytest.mark.parametrize("tiles", KERNELS)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 11, 15, 17, 32, 33, 64, 100])
def test_products_are_the_bf16_paths_up_to_summation_order(rows, kind, tiles):
    w = RANDOM[kind](96, 576, seed=rows)
    t = amx.pack(w)
    x = torch.randn(rows, 600)[:, 7:583]  # strided rows
    ref = bf16_reference(x, w)
    scale = ref.abs().max().item()
    y = amx.linear(x, t, tiles=tiles)
    assert y.dtype == torch.float32 and y.shape == (rows, 96)
    assert (y.double() - ref).abs().max().item() < 1e-5 * scale  # float32 sums of exact bf16 products
    yb = amx.linear(x.to(torch.bfloat16), t, torch.bfloat16, tiles=tiles)  # bf16 in and out (the MLP's chain)
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, y.to(torch.bfloat16)) or (yb.double() - ref).abs().max().item() < 8e-3 * scale


@pytest.mark.parametrize("tiles", KERNELS)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(tiles):
    """Speculative verification adds draft rows to a step (quant/linear_method.py path_rows): each row's
    product must be the same bits whatever else is in the call."""
    w = random_q4_1(64, 1536, seed=3)
    t = amx.pack(w)
    x = torch.randn(64, 1536)
    whole = amx.linear(x, t, tiles=tiles)
    for lo, hi in [(0, 1), (5, 9), (16, 48), (40, 64), (3, 29)]:
        assert torch.equal(amx.linear(x[lo:hi], t, tiles=tiles), whole[lo:hi])


@pytest.mark.parametrize("tiles", KERNELS)
@pytest.mark.parametrize("rows", [7, 16, 37, 130])
def test_bf16_rows_read_in_place_or_copied_give_the_same_bits(rows, tiles):
    """bf16 x whose rows sit on cache-line boundaries is read in place (a last partial row tile copied with zero
    rows), other x copied by the threads (float32 rounded on the way): the same product either way."""
    w = random_q4_1(64, 576, seed=rows)
    t = amx.pack(w)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    assert x.data_ptr() % 64 == 0  # torch's CPU allocator: the in-place path
    in_place = amx.linear(x, t, tiles=tiles)
    unaligned = torch.empty(rows, 600, dtype=torch.bfloat16)[:, 3:579]  # rows 1,200 bytes apart, off a line
    unaligned.copy_(x)
    assert torch.equal(amx.linear(unaligned, t, tiles=tiles), in_place)
    # x already bf16-exact: rounding changes nothing
    assert torch.equal(amx.linear(x.float(), t, tiles=tiles), in_place)
    assert torch.equal(amx.linear(x[1:], t, tiles=tiles), in_place[1:])  # a view one row (1,152 bytes) on


def test_platform_chooses_amx_only_under_auto_where_tiles_run(monkeypatch):
    import pagellm.platforms.cpu as cpu
    from pagellm.kernels.build import build_info

    p = get_platform("cpu")
    # the tile path is compiled where the compiler targets AMX-TILE/BF16 with AVX-512 BF16 (what -march gave the
    # kernels), and used only where the CPU reports amx_bf16 and the OS granted the tile state
    build = build_info() if p.native_kernels else None
    compiled = build is not None and {"amx_tile", "amx_bf16", "avx512bf16", "avx512bw"} <= set(build["isa"])
    assert compiled == (build is not None and "amx-bf16-q4" in build["paths"])
    assert p.amx_tiles == (compiled and "amx_bf16" in p.isa and amx.amx_ready())
    assert amx.amx_ready() <= compiled
    # the vdpbf16ps twin where the build has AVX-512 BF16 (and the CPU reports it), for CPUs without AMX
    assert (build is not None and "avx512-bf16-q4" in build["paths"]) == (
        build is not None and {"avx512bf16", "avx512bw"} <= set(build["isa"]))
    assert p.bf16dp_products == (amx.bf16dp_ready() and "avx512_bf16" in p.isa)
    assert p.op_choices(torch.float32).amx_max_rows == 0  # an explicit float32 stays exact
    auto = p.op_choices(torch.float32, auto=True)
    assert auto.amx_max_rows == (cpu.AMX_MAX_ROWS if p.amx_tiles else cpu.BF16DP_MAX_ROWS if p.bf16dp_products
                                 else 0)
    assert auto.amx_on_tiles == (p.amx_tiles or not p.bf16dp_products)
    monkeypatch.setenv("PAGELLM_CPU_AMX", "0")
    assert not p.amx_tiles and not p.bf16dp_products and p.op_choices(torch.float32, auto=True).amx_max_rows == 0


@needs_tile_products
@pytest.mark.slow
def test_engine_decodes_on_amx_tiles_within_the_auto_bounds(smollm_gguf_path, monkeypatch):
    """Under auto, a batch of 24 decodes through the products over tile-order blocks (AMX, else vdpbf16ps: the
    q4_1 layers and the q8_0 LM head, or its one-plane int8 products where the platform chose them): greedy
    logprobs against float32 within the bounds `--dtype auto` states (tests/test_dtype_auto.py). The LM head's
    logits stay float32 here, where oneDNN's bf16 product rounds them to bf16 (PAGELLM_CPU_AMX=0)."""
    import statistics

    from conftest import agreeing_logprob_diffs
    from test_dtype_auto import AUTO_LOGPROB_MEDIAN_TOL, AUTO_LOGPROB_TOL, AUTO_WIDE_MARGIN

    from pagellm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = [f"Item {i}: the capital of country number {i} in a long list of countries is" for i in range(24)]
    tiles = LLM(smollm_gguf_path, dtype="auto")
    assert tiles.engine.model.layers[0].mlp.down_proj.amx_blocks is not None  # q4_1
    head = tiles.engine.model.lm_head  # the tied embedding's q8_0 blocks: in AMX tile order, or in int8 tile order
    assert head.packed.kind == "q8_0"  # alone where the platform multiplies the head on one-plane int8 (int8_head)
    if head.quant_method.choices.int8_head:
        assert head.amx_blocks is None and head.int8_tiles is not None and head.weight_bf16 is None
    else:
        assert head.amx_blocks.kind == "q8_0"
    monkeypatch.setenv("PAGELLM_CPU_AMX", "0")
    assert LLM(smollm_gguf_path, dtype="auto").engine.model.layers[0].mlp.down_proj.amx_blocks is None
    exact = LLM(smollm_gguf_path, dtype="float32")
    a = exact.generate(prompts, params, use_tqdm=False)
    b = tiles.generate(prompts, params, use_tqdm=False)
    diffs = agreeing_logprob_diffs([o.outputs[0] for o in a], [o.outputs[0] for o in b], AUTO_WIDE_MARGIN)
    assert len(diffs) >= 150
    assert statistics.median(diffs) < AUTO_LOGPROB_MEDIAN_TOL and max(diffs) < AUTO_LOGPROB_TOL


@needs_tile_products
@pytest.mark.slow
def test_native_decoder_runs_amx_steps_as_the_module_path(smollm_gguf_path):
    """The one-call decoder takes the steps between the few-row kernels' limit and AMX_MAX_ROWS (BF16DP_MAX_ROWS
    without AMX) with the module path's bf16 chain (products over tile-order blocks with bf16 outputs, rope_bf16,
    add_bf16_rmsnorm, silu_mul_bf16), op for op: the same logits with it and without it."""
    import pagellm.platforms.cpu as cpu
    from pagellm import LLM, SamplingParams

    llm = LLM(smollm_gguf_path, dtype="auto")
    runner = llm.engine.runner
    compiled = runner.compiled_decoder
    limit = cpu.AMX_MAX_ROWS if get_platform("cpu").amx_tiles else cpu.BF16DP_MAX_ROWS
    assert compiled is not None and compiled.amx_max_rows == limit
    amx_steps = []
    forward = compiled.forward

    def counting(*args):
        amx_steps.append(compiled.amx_step)
        return forward(*args)

    compiled.forward = counting
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    # decode steps of 20 rows: past every few-row limit (cpu.py: at most 12), within every tile-order one
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(20)]
    runner.compiled_decoder = compiled
    with_native = llm.generate(prompts, params, use_tqdm=False)
    assert sum(amx_steps) >= 10
    runner.compiled_decoder = None
    llm.reset_prefix_cache()
    without = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(with_native, without, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
