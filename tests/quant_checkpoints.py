"""Writes tiny quantized HF checkpoints (GPTQ, AWQ, FP8, compressed-tensors) from a float one, by
round-to-nearest, each in its format's own tensor layout; never downloads anything.

The packing here is written from the formats' descriptions, independently of pagellm's unpacking, so a
mistake on either side shows. `reference` holds each module's weight by the format's own formula
(scale * (q - zero), f8 * scale), the value a correct loader must reproduce within float rounding.
"""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along(codes: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """codes (unsigned) -> int32 words of 32 // bits codes along `dim`; code i of a word at bits i*bits
    (with `order`: element order[i] of the word's run)."""
    per = 32 // bits
    c = codes.to(torch.int64).movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
    words = torch.zeros(c.shape[:-1], dtype=torch.int64)
    for i in range(per):
        words |= c[..., order[i] if order else i] << (bits * i)
    return to_int32(words).movedim(-1, dim).contiguous()


def rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool, g_idx: torch.Tensor | None = None,
        min_zero: int = 0):
    """Round-to-nearest: (codes uint [N, K], scale fp16 [N, G], zero int [N, G]) with unsigned codes and
    zeros; group of column c = g_idx[c] (default c // group_size; group_size -1: one group)."""
    n, k = w.shape
    g = g_idx if g_idx is not None else (torch.arange(k) // group_size if group_size > 0 else torch.zeros(k).long())
    groups = int(g.max()) + 1
    top = 2**bits - 1
    scale, zero = torch.empty(n, groups), torch.empty(n, groups)
    for j in range(groups):
        cols = w[:, g == j]
        if sym:
            scale[:, j] = cols.abs().amax(1).clamp_min(1e-6) * 2 / top
            zero[:, j] = 2 ** (bits - 1)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scale[:, j] = ((hi - lo) / top).clamp_min(1e-6)
            zero[:, j] = torch.round(-lo / scale[:, j].half().float()).clamp(min_zero, top)
    scale = scale.half()
    zero = zero.long()
    codes = torch.round(w / scale.float()[:, g]) + zero[:, g]
    return codes.clamp(0, top).long(), scale, zero


def formula(codes, scale, zero, g):
    return scale.float()[:, g] * (codes.float() - zero.float()[:, g])


def gptq_tensors(w, bits=4, group_size=32, sym=True, v1=True, perm: torch.Tensor | None = None):
    """GPTQ layout; perm: act-order (column perm[j] is the j-th quantized, so in group j // group_size)."""
    n, k = w.shape
    gs = group_size if group_size > 0 else k
    g_idx = torch.arange(k) // gs
    if perm is not None:
        g_idx = torch.empty(k, dtype=torch.long).index_put_((perm,), torch.arange(k) // gs)
    codes, scale, zero = rtn(w, bits, group_size, sym, g_idx, min_zero=1 if v1 else 0)
    stored_zero = zero - 1 if v1 else zero
    t = {"qweight": pack_along(codes.t(), bits, 0), "qzeros": pack_along(stored_zero.t(), bits, 1),
         "scales": scale.t().contiguous(), "g_idx": g_idx.to(torch.int32)}
    return t, formula(codes, scale, zero, g_idx)


def awq_tensors(w, group_size=32, zero_point=True):
    n, k = w.shape
    g = torch.arange(k) // group_size if group_size > 0 else torch.zeros(k).long()
    codes, scale, zero = rtn(w, 4, group_size, not zero_point)
    t = {"qweight": pack_along(codes.t(), 4, 1, AWQ_ORDER), "scales": scale.t().contiguous()}
    if zero_point:
        t["qzeros"] = pack_along(zero.t(), 4, 1, AWQ_ORDER)
    return t, formula(codes, scale, zero, g)


def fp8_tensors(w, scheme="tensor", block=(128, 128), static=False):
    """vLLM fp8: weight_scale per tensor / per channel, or weight_scale_inv per block."""
    n, k = w.shape
    if scheme == "block":
        bn, bk = block
        s = torch.empty(math.ceil(n / bn), math.ceil(k / bk))
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                s[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max().clamp_min(1e-6) / 448
        full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    elif scheme == "channel":
        s = w.abs().amax(1, keepdim=True).clamp_min(1e-6) / 448
        full = s.expand(n, k)
    else:
        s = w.abs().max().clamp_min(1e-6) / 448
        full = s.expand(n, k)
    q = (w / full).to(torch.float8_e4m3fn)
    t = {"weight": q, ("weight_scale_inv" if scheme == "block" else "weight_scale"): s.float()}
    if static:
        t["input_scale"] = torch.tensor(0.05)
    return t, q.float() * full


def ct_tensors(w, fmt: str, bits=4, strategy="group", group_size=32, sym=True, kind="int"):
    """compressed-tensors, through the library's own compressors (pack/int/naive/float-quantized)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    n, k = w.shape
    args = QuantizationArgs(num_bits=bits, type=kind, symmetric=sym, strategy=strategy,
                            group_size=group_size if strategy == "group" else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    if kind == "float":
        s = (w.abs().amax(1, keepdim=True) if strategy == "channel" else w.abs().max().reshape(1)) / 448
        state = {"weight": w, "weight_scale": s.float()}
        ref = w.div(s).to(torch.float8_e4m3fn).float() * s
    else:
        codes, scale, zero = rtn(w, bits, group_size if strategy == "group" else -1, sym)
        offset = 2 ** (bits - 1)
        g = torch.arange(k) // group_size if strategy == "group" else torch.zeros(k).long()
        state = {"weight": w, "weight_scale": scale.float()}
        if not sym:
            state["weight_zero_point"] = (zero - offset).to(torch.int8)
        ref = formula(codes, scale.float(), zero, g)
    out = BaseCompressor.load_from_registry(fmt).compress(state, scheme)
    return {p: t.contiguous() for p, t in out.items()}, ref, scheme


def ct_config(fmt: str, scheme, ignore=("lm_head",)) -> dict:
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=list(ignore),
                            quantization_status="compressed")
    d = qc.model_dump(mode="json")
    d["quant_method"] = "compressed-tensors"
    return d


def _load_state(src_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory's safetensors files."""
    state = {}
    for f in sorted(os.listdir(src_dir)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(src_dir, f)))
    return state


def write_quantized(src_dir: str, out_dir: str, method: str, quant_config: dict, make, legacy_config=False,
                    modules=LINEARS) -> dict[str, torch.Tensor]:
    """Copies src_dir's float model to out_dir with each layer's `modules` replaced by make(name, w) ->
    (tensors by part, reference weight); returns name -> reference weight."""
    os.makedirs(out_dir, exist_ok=True)
    state = _load_state(src_dir)
    with open(os.path.join(src_dir, "config.json")) as f:
        cfg = json.load(f)
    out, refs = {}, {}
    for name, t in state.items():
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and any(prefix.endswith(m) for m in modules):
            tensors, ref = make(prefix, t.float())
            refs[name] = ref
            out.update({f"{prefix}.{p}": v for p, v in tensors.items()})
        else:
            out[name] = t
    if legacy_config:
        with open(os.path.join(out_dir, "quantize_config.json"), "w") as f:
            json.dump(quant_config, f)
    else:
        cfg["quantization_config"] = {"quant_method": method, **quant_config}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(out, os.path.join(out_dir, "model.safetensors"))
    return refs


def write_float(src_dir: str, out_dir: str, weights: dict[str, torch.Tensor]) -> str:
    """src_dir's float model with `weights` (name -> tensor) replaced: the float32 reference model."""
    os.makedirs(out_dir, exist_ok=True)
    state = _load_state(src_dir)
    state = {n: t for n, t in state.items() if n.endswith((".weight", ".bias"))}  # drop quantized parts
    state.update({n: w.float().contiguous() for n, w in weights.items()})
    save_file({n: t.float().contiguous() for n, t in state.items()}, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(src_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out_dir
