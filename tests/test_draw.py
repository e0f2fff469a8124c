"""Categorical draws by inverse CDF (sample/draw.py): the native kernel and the torch path agree, never draw a token
without probability, sample the right distribution, and a seeded row's draw does not depend on its neighbours."""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels import ops
from pagellm.kernels.build import cpu_kernels
from pagellm.sample import draw
from pagellm.sample.draw import categorical, uniforms

pytestmark = pytest.mark.timeout(60)
needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="native CPU kernels not built")


def torch_path(probs: torch.Tensor, u: torch.Tensor, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(draw, "native_rows", lambda x: False)
        return categorical(probs, u)


@needs_kernels
def test_native_and_torch_draws_agree(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    probs = (torch.randn(64, 49_152, generator=gen) * 3).softmax(-1)
    probs[::3, 1000:] = 0.0  # masked tails
    probs[1] *= 7.5  # any scale: the draw reads the row's own total
    u = torch.rand(64, dtype=torch.float64, generator=gen)
    native = ops.sample_rows(probs, u)
    assert native is not None and native.tolist() == torch_path(probs, u, monkeypatch).tolist()


@pytest.mark.parametrize("native", [True, False])
def test_only_tokens_with_mass_are_drawn_at_the_ends_of_u(native, monkeypatch):
    if native and cpu_kernels() is None:
        pytest.skip("native CPU kernels not built")
    probs = torch.zeros(4, 200)
    probs[:, [3, 70, 150]] = torch.tensor([0.25, 0.5, 0.25])
    probs[3, 150] = 0.0  # its last token with mass is 70
    u = torch.tensor([0.0, 0.5, 1.0 - 2.0**-53, 1.0 - 2.0**-53], dtype=torch.float64)
    got = categorical(probs, u) if native else torch_path(probs, u, monkeypatch)
    assert got.tolist() == [3, 70, 150, 70]


@pytest.mark.parametrize("native", [True, False])
def test_draws_follow_the_distribution(native, monkeypatch):
    if native and cpu_kernels() is None:
        pytest.skip("native CPU kernels not built")
    p = torch.zeros(300)
    p[[0, 5, 64, 65, 299]] = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])  # across block boundaries and the tail
    n = 100_000
    probs = p.expand(n, -1).contiguous()
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = categorical(probs, u) if native else torch_path(probs, u, monkeypatch)
    freq = torch.bincount(got, minlength=300).double() / n
    assert set(got.unique().tolist()) == {0, 5, 64, 65, 299}
    # binomial standard error at n = 100,000 is <= 0.0016: 5 sigma
    assert (freq - p.double()).abs().max() < 0.008


def test_a_seeded_row_draws_the_same_alone_and_in_a_batch():
    probs = torch.rand(5, 1000).softmax(-1)
    alone = categorical(probs[2:3], uniforms([torch.Generator().manual_seed(7)]))
    batch = categorical(probs, uniforms([None, torch.Generator().manual_seed(3), torch.Generator().manual_seed(7),
                                         None, None]))
    assert batch[2] == alone[0]


def test_rows_without_mass_get_an_index_in_range():
    probs = torch.zeros(3, 100)
    probs[0, 4] = 1.0
    probs[2, 7] = float("nan")
    got = categorical(probs, torch.full((3,), 0.5, dtype=torch.float64))
    assert got[0] == 4 and ((got >= 0) & (got < 100)).all()


@needs_kernels
def test_softmax_draw_matches_the_softmax_then_the_draw(monkeypatch):
    """The fused native temperature + softmax + draw against torch's softmax and the draw, same uniforms: the
    weights differ by exp's rounding (~1e-7 relative), so at most a row whose uniform lands on a boundary parts."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 49_152, generator=gen) * 4
    x[5, 100:] = float("-inf")  # a row masked down to 100 tokens: those never come
    temps = [0.3 + 0.05 * i for i in range(64)]
    u = torch.rand(64, dtype=torch.float64, generator=gen)
    fused = draw.softmax_categorical(x, temps, u)
    with monkeypatch.context() as m:
        m.setattr(draw, "native_rows", lambda x: False)
        reference = draw.softmax_categorical(x, temps, u)
    assert (fused == reference).sum() >= 63 and fused[5] < 100
    assert torch.isfinite(x).sum() == 63 * 49_152 + 100  # x untouched


def test_softmax_draw_follows_the_distribution():
    logits = torch.tensor([2.0, 0.0, float("-inf"), 1.0, -1.0] + [float("-inf")] * 60)
    n, t = 100_000, 0.8
    x = logits.expand(n, -1).contiguous()
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = draw.softmax_categorical(x, [t] * n, u)
    freq = torch.bincount(got, minlength=65).double() / n
    assert freq[2] == 0 and freq[5:].sum() == 0
    assert (freq - (logits / t).softmax(-1).double()).abs().max() < 0.008


def test_softmax_draw_rows_without_a_maximum_fall_back(monkeypatch):
    """Rows of only -inf, with a NaN or with +inf are the torch path's whatever the kernels (one rule: an index in
    range, the sampler's mask check refuses a masked one), not a draw among the row's finite logits."""
    x = torch.zeros(4, 50)
    x[1] = float("-inf")
    x[2, 7], x[3, 9] = float("nan"), float("inf")
    u = torch.full((4,), 0.5, dtype=torch.float64)
    got = draw.softmax_categorical(x, [1.0] * 4, u)
    with monkeypatch.context() as m:
        m.setattr(draw, "native_rows", lambda x: False)
        assert got.tolist() == draw.softmax_categorical(x, [1.0] * 4, u).tolist()
    assert got[0] == 25 and ((got >= 0) & (got < 50)).all()
