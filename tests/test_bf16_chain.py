"""The bfloat16 chain of `--dtype auto` between its products (norm, rotary, activation): the same bits as the
float32 ops they replace followed by torch's casts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.kernels import cpu_kernels, ops

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="native CPU kernels could not be built here")


def test_bf16_residual_norm_is_the_float32_norm_of_its_cast():
    """A bf16 product's output goes to the next norm as is (--dtype auto): summed into the residual in
    float32, the same bits as casting it first, and RMSNorm takes that path for a bf16 x."""
    from pagellm.model.layers.norm import RMSNorm

    x, res, w = torch.randn(7, 576).bfloat16(), torch.randn(7, 576), torch.randn(576)
    x32, res32 = x.float(), res.clone()
    want = ops.add_rmsnorm(x32, res32, w, 1e-5)  # x32 becomes the sum
    got = ops.add_bf16_rmsnorm(x, res, w, 1e-5)
    assert torch.equal(got, want) and torch.equal(res, x32)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data.copy_(w)
    norm.use("cpu")
    res2 = torch.randn(7, 576)  # a fresh residual stream
    want_out, want_sum = norm(x.float(), res2.clone())
    out, summed = norm(x, res2)
    assert summed is res2 and torch.equal(out, want_out) and torch.equal(summed, want_sum)
    assert torch.equal(norm(x), norm(x.float()))  # no residual: cast first


def test_bf16_qkv_rotates_as_its_float32_cast():
    """A bf16 qkv product's output (--dtype auto) is cast and rotated in one pass: the bits of casting first
    and rotating in place, rows strided as a slice of a wider output would be."""
    from pagellm.model.layers.rotary import RotaryEmbedding

    rot = RotaryEmbedding(64, 256, 10000.0)
    wide = torch.randn(6, 960 + 32).bfloat16()
    qkv = wide[:, :960]  # 9 q + 3 k + 3 v heads of 64, row stride 992
    pos = torch.tensor([0, 3, 17, 100, 200, 255])
    want = qkv.float().contiguous()
    ops.rope_(want, 12, 64, rot.cos, rot.sin, pos)
    assert torch.equal(ops.rope_bf16(qkv, 12, 64, rot.cos, rot.sin, pos), want)
    rot.use("cpu")
    assert torch.equal(rot(pos, qkv, 12, torch.float32), want)  # the model's activations are float32
    rot.use("native")
    torch.testing.assert_close(rot(pos, qkv, 12, torch.float32), want, rtol=1e-6, atol=1e-6)
    assert rot(pos, qkv.clone(), 12, torch.bfloat16).dtype == torch.bfloat16  # a bf16 model stays bf16


def test_norm_hands_a_bf16_product_the_bits_it_would_round_to():
    """bf16_out (the next product rounds its input to bf16: --dtype auto, many rows): the norm's output rounded
    to bf16 in the kernel is its float32 output's .to(torch.bfloat16), with the residual stream as before, for a
    bf16 x (residual updated), a float32 x with a residual (x updated) and without (layer 0: x only read), in the
    vector body and the scalar tail (100 = 6 x 16 + 4 columns)."""
    from pagellm.model.layers.norm import RMSNorm

    torch.manual_seed(0)
    for t, c in [(1, 576), (7, 576), (5, 100)]:
        w = torch.randn(c)
        x, res = torch.randn(t, c).bfloat16(), torch.randn(t, c)
        res_ref = res.clone()
        want = ops.add_bf16_rmsnorm(x, res_ref, w, 1e-5).bfloat16()
        got = ops.rmsnorm_to_bf16(x, res, w, 1e-5)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want) and torch.equal(res, res_ref)
        x32, res = torch.randn(t, c) * 1e3, torch.randn(t, c)
        x_ref = x32.clone()
        want = ops.add_rmsnorm(x_ref, res, w, 1e-5).bfloat16()
        got = ops.rmsnorm_to_bf16(x32, res, w, 1e-5)
        assert torch.equal(got, want) and torch.equal(x32, x_ref)
        before = x32.clone()
        want = ops.add_rmsnorm(x32.clone(), None, w, 1e-5).bfloat16()
        assert torch.equal(ops.rmsnorm_to_bf16(x32, None, w, 1e-5), want)
        assert torch.equal(x32, before)
    # subnormal outputs stay subnormal (as torch's cast keeps them), in the vector body and the tail
    x32, w = torch.ones(2, 33), torch.full((33,), 3e-39)
    want = ops.add_rmsnorm(x32.clone(), None, w, 1e-5).bfloat16()
    got = ops.rmsnorm_to_bf16(x32, None, w, 1e-5)
    assert torch.equal(got, want) and (got != 0).all()
    x32[1, 3] = float("nan")  # a NaN row stays NaN
    assert ops.rmsnorm_to_bf16(x32, None, w, 1e-5)[1].isnan().all()
    norm = RMSNorm(576, 1e-5)
    norm.weight.data.normal_()
    norm.use("cpu")
    x, res = torch.randn(7, 576).bfloat16(), torch.randn(7, 576)
    want_out, want_sum = norm(x, res.clone())
    out, summed = norm(x, res, bf16_out=True)
    assert summed is res and torch.equal(summed, want_sum) and torch.equal(out, want_out.bfloat16())
    x32 = torch.randn(7, 576)
    assert torch.equal(norm(x32, bf16_out=True), norm(x32).bfloat16())
    norm.use("native")  # ignores the hint: the product rounds
    assert norm(x32, bf16_out=True).dtype == torch.float32


def test_bf16_silu_mul_rounds_once_as_torch_does():
    """The bf16 MLP's activation: float32 arithmetic on the bf16 inputs, one round-to-nearest-even to bf16
    (vector body and scalar tail: 1536 = 8 x 192 columns, 13 columns leave a tail of 5)."""
    torch.manual_seed(0)
    for t, i in [(1, 8), (5, 1536), (33, 13)]:
        g = (torch.randn(t, 2 * i) * 4).bfloat16()
        g[0, 0], g[0, i] = 1e38, 1e38  # silu(x) * u beyond bf16's range rounds to inf, as torch's cast does
        out = ops.silu_mul(g)
        ref = (F.silu(g.float()[:, :i]) * g.float()[:, i:]).bfloat16()
        assert out.dtype == torch.bfloat16
        exact = out.view(torch.int16) == ref.view(torch.int16)
        # exp differs from libm's in the last float32 bit, which can move a value sitting on a rounding tie
        assert exact.float().mean() > 0.999 and torch.allclose(out.float(), ref.float(), rtol=2**-8, atol=0)
        assert out[0, 0].isinf()
