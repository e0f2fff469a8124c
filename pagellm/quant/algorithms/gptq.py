"""GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", 2022): quantize one column at a time and spread its rounding error over the columns not yet
quantized, weighted by the inverse Hessian of the layer's reconstruction loss ||W X - W_q X||^2.

H = 2 X X^T / n over calibration inputs X [K, n]. Dampening (a fraction of the mean diagonal) keeps it
positive definite; the upper Cholesky factor of H^-1 gives each column's error-feedback row. Columns are
processed in blocks of 128 whose updates to later blocks are applied once per block (lazy batch updates).
With act-order (desc_act) columns go in order of decreasing H diagonal (the most activated first), and
groups are consecutive in that order: g_idx then maps each natural column to its group.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from pagellm.quant.algorithms.rtn import GroupQuant, group_params, quantize_codes

BLOCK_COLUMNS = 128


def hessian(x: torch.Tensor) -> torch.Tensor:
    """H = 2 X X^T / n of a layer's calibration inputs (float64: sums of many products)."""
    x = x.reshape(-1, x.shape[-1]).to(torch.float64)
    return torch.mm(x.t(), x).mul_(2 / x.shape[0])


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int, sym: bool,
                  desc_act: bool = False, damp: float = 0.01) -> GroupQuant:
    """w: float [N, K]; h: [K, K] from hessian(). Returns codes in natural column order."""
    with one_thread():
        return _gptq(w, h, bits, group_size, sym, desc_act, damp)


def _gptq(w, h, bits: int, group_size: int, sym: bool, desc_act: bool, damp: float) -> GroupQuant:
    n, k = w.shape
    if k % group_size or BLOCK_COLUMNS % group_size:
        raise ValueError(f"group size {group_size} must divide the input size {k} and {BLOCK_COLUMNS}")
    w = w.to(torch.float64).clone()
    h = h.to(torch.float64).clone()
    dead = torch.diag(h) == 0  # inputs that were always zero: their weights cannot matter
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True) if desc_act else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    u = _inverse_cholesky_upper(h, damp)

    q = torch.zeros(n, k, dtype=torch.int32)
    scales = torch.zeros(n, k // group_size)
    zeros = torch.zeros(n, k // group_size, dtype=torch.int32)
    _quantize_columns(w, u, q, scales, zeros, bits, group_size, sym)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = torch.arange(k, dtype=torch.int32) // group_size
    natural = torch.empty_like(q).index_copy_(1, perm, q)
    return GroupQuant(natural, scales, zeros, g_idx, bits)


def _quantize_columns(w, u, q, scales, zeros, bits: int, group_size: int, sym: bool) -> None:
    """The column loop, writing codes, scales and zeros in place (columns in processing order)."""
    k = w.shape[1]
    for b0 in range(0, k, BLOCK_COLUMNS):
        b1 = min(b0 + BLOCK_COLUMNS, k)
        wb, ub = w[:, b0:b1].clone(), u[b0:b1, b0:b1]
        errors = torch.zeros_like(wb)
        for i in range(b1 - b0):
            col = b0 + i
            if col % group_size == 0:  # the group's grid, from its columns as updated so far
                scale, zero = group_params(wb[:, i:i + group_size].float(), bits, sym)
                g = col // group_size
                scales[:, g], zeros[:, g] = scale[:, 0], zero[:, 0]
                scale, zero = scale.double(), zero.double()
            codes = quantize_codes(wb[:, i:i + 1], scale, zero, bits)
            q[:, col] = codes[:, 0]
            err = (wb[:, i] - (codes[:, 0] - zero[:, 0]) * scale[:, 0]) / ub[i, i]
            wb[:, i:] -= err[:, None] * ub[i, i:][None, :]
            errors[:, i] = err
        w[:, b1:] -= errors @ u[b0:b1, b1:]  # the block's lazy update of every later column


@contextmanager
def one_thread():
    """Thousands of small ops (the column loop) and small float64 factorizations: thread fork/join costs
    more than it saves (on a loaded 2-core VM, 2 threads ran one 1152x576 GPTQ step an order of magnitude
    slower than 1, in one manual run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _inverse_cholesky_upper(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1; more dampening if H is singular."""
    mean_diag = torch.diag(h).mean()
    for attempt in range(4):
        hd = h + torch.eye(h.shape[0], dtype=h.dtype) * damp * (10**attempt) * mean_diag
        lower, info = torch.linalg.cholesky_ex(hd)
        if info == 0:
            inv = torch.cholesky_inverse(lower)
            upper, info = torch.linalg.cholesky_ex(inv, upper=True)
            if info == 0:
                return upper
    raise ValueError("the calibration Hessian is not positive definite even with 1000x dampening "
                     "(too few calibration tokens? raise --num-samples or --seq-len)")
