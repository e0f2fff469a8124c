"""AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration",
2023): scale up the input channels that carry large activations before rounding, so their weights lose
less, and divide the activations by the same scales (folded into the op that produces them).

For a group of linears that read the same input x [T, K] (q/k/v, gate/up, or one linear), the scales are
s = mean|x|^alpha per input channel, normalized to a geometric mean of about 1, with alpha picked from a
grid on [0, 1) by the error ||x W^T - x (Q(W diag(s)) diag(s)^-1)^T||^2. alpha = 0 (s = 1) is plain
round-to-nearest, so on the calibration data the chosen scales are never worse than RTN.
"""

from __future__ import annotations

import torch

from pagellm.quant.algorithms.gptq import one_thread
from pagellm.quant.algorithms.rtn import fake_quantize

GRID = 20
MAX_ROWS = 4096  # activation rows the search evaluates (an even subsample of the calibration tokens)


def search_scales(x: torch.Tensor, weights: list[torch.Tensor], bits: int, group_size: int,
                  grid: int = GRID) -> tuple[torch.Tensor, float, float]:
    """x: [T, K] inputs; weights: [N_i, K] matrices that read them. Returns (s [K], best error, RTN error)."""
    with one_thread():
        return _search(x, weights, bits, group_size, grid)


def _search(x, weights, bits: int, group_size: int, grid: int) -> tuple[torch.Tensor, float, float]:
    x = x.reshape(-1, x.shape[-1]).float()
    if x.shape[0] > MAX_ROWS:
        x = x[torch.linspace(0, x.shape[0] - 1, MAX_ROWS).long()]
    w = torch.cat(weights).float()
    ref = x @ w.t()
    x_mean = x.abs().mean(dim=0)
    best, best_s, rtn_err = float("inf"), torch.ones_like(x_mean), None
    for i in range(grid):
        alpha = i / grid
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        wq = fake_quantize(w * s, bits, group_size, sym=False) / s
        err = (x @ wq.t() - ref).pow(2).mean().item()
        if i == 0:
            rtn_err = err
        if err < best:
            best, best_s = err, s
    return best_s, best, rtn_err
