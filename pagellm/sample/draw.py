"""Categorical draws: one uniform per row, then the inverse CDF (the first token whose running sum of probabilities
passes it). An exact draw like the exponential race (argmax of p / Exp(1) noise) it replaces, which needs a noise
value and a logarithm per token: for 64 rows of 49,152 tokens on the Xeon VM the race took 62 ms, the native inverse
CDF 0.35 ms (benchmarks/microbench_sampling.py; NOTES, thirtieth session). A seeded row draws its uniform
from its own generator, so its token does not depend on batch size, row index or neighbours."""

from __future__ import annotations

import torch

from pagellm.kernels import ops
from pagellm.sample.logprobs import native_rows


def uniforms(generators: list[torch.Generator | None], device: torch.device | str = "cpu") -> torch.Tensor:
    """[rows] float64 uniforms in [0, 1) on `device`: rows without a generator from the device's global one (one
    call), the others one each from their own (drawn where it lives, then copied: no host sync on a GPU)."""
    u = torch.empty(len(generators), dtype=torch.float64, device=device)
    plain = [i for i, g in enumerate(generators) if g is None]
    if len(plain) == len(generators):
        return u.uniform_()
    if plain:
        u[plain] = torch.rand(len(plain), dtype=torch.float64, device=device)
    for i, gen in enumerate(generators):
        if gen is not None:
            u[i:i + 1].copy_(torch.rand(1, dtype=torch.float64, generator=gen, device=gen.device))
    return u


def categorical(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[rows] int64 token ids on probs' device, drawn from each row of probs ([rows, n], not necessarily
    normalized) with u ([rows] uniforms in [0, 1)). Only a token with probability > 0 is drawn; a row without any
    (all masked, NaN) gets some index, which the sampler's mask check then refuses."""
    if native_rows(probs):
        drawn = ops.sample_rows(probs, u.contiguous())
        if drawn is not None:
            return drawn
    n = probs.shape[1]
    cum = probs.double().cumsum(dim=-1)
    target = u.to(device=probs.device, dtype=torch.float64)[:, None] * cum[:, -1:]
    idx = torch.searchsorted(cum, target, right=True).squeeze(1).clamp_(max=n - 1)
    # u < 1 keeps the target under the total; rounded, it may reach it: then the last token with mass
    last = n - 1 - (probs > 0).flip(-1).to(torch.uint8).argmax(dim=-1)
    return torch.where(probs.gather(1, idx[:, None]).squeeze(1) > 0, idx, last)


def softmax_categorical(x: torch.Tensor, temperatures: list[float], u: torch.Tensor) -> torch.Tensor:
    """categorical(softmax(x / T)) per row, x left untouched: on the CPU in one native call that never builds the
    probabilities (64 x 49,152 logits: torch's copy, division and softmax 1.8-8.2 ms in four runs, this 0.9 ms;
    benchmarks/microbench_sampling.py)."""
    if native_rows(x):
        inv = torch.tensor([1.0 / t for t in temperatures], dtype=torch.float32)
        drawn = ops.softmax_draw(x, inv, u.contiguous())
        if drawn is not None:
            return drawn
    t = torch.tensor(temperatures, dtype=torch.float32, device=x.device)[:, None]
    return categorical((x.float() / t).softmax(dim=-1), u)
