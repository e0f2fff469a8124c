"""The layer-by-layer drivers of `pagellm quantize`: which matrices each method quantizes, from what inputs.

Every method quantizes the decoder layers' seven linears (q/k/v/o, gate/up/down) and leaves the embedding,
the final norm and the LM head in float, as GPTQ and AWQ checkpoints conventionally do. Matrices reading
the same input (q/k/v; gate/up) share one GPTQ Hessian and one AWQ scale vector; GPTQ quantizes them as one
stacked matrix (its error feedback never crosses rows, so that equals quantizing each alone). After a layer
is quantized its dequantized weights replace the float ones in `state`, so the next layer's inputs come from
the quantized model (GPTQ's sequential scheme).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pagellm.model_config import ModelConfig
from pagellm.quant.algorithms.awq import search_scales
from pagellm.quant.algorithms.gptq import gptq_quantize, hessian
from pagellm.quant.algorithms.rtn import GroupQuant, rtn_quantize
from pagellm.quant.calibration import ATTN, MLP, LayerWeights, LlamaLayerRunner, embed

logger = logging.getLogger(__name__)


@dataclass
class QuantizeSettings:
    method: str  # rtn | gptq | awq
    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    keep: list[str]  # module-name substrings left in float

    def kept(self, weight_name: str) -> bool:
        module = weight_name.removesuffix(".weight")
        return any(k in module for k in self.keep)


def quantize_state(state: dict[str, torch.Tensor], cfg: ModelConfig, settings: QuantizeSettings,
                   tokens: torch.Tensor | None) -> dict[str, GroupQuant]:
    """Quantizes every decoder linear not kept; returns weight name -> codes (state then holds the dequantized
    weights, and for AWQ the norm and v/up weights the scales were folded into)."""
    out: dict[str, GroupQuant] = {}
    if settings.method == "rtn":
        for i in range(cfg.num_hidden_layers):
            lw = LayerWeights(state, i)
            for proj in ATTN + MLP:
                _store(out, lw, [proj], settings, rtn_quantize(lw.w(proj), settings.bits, settings.group_size,
                                                               settings.sym))
        return out
    runner = LlamaLayerRunner(cfg, tokens.shape[1])
    layer_step = _gptq_layer if settings.method == "gptq" else _awq_layer
    x = embed(state, tokens).float()
    for i in range(cfg.num_hidden_layers):
        t0 = time.perf_counter()
        lw = LayerWeights(state, i)
        errors = layer_step(lw, runner, x, settings, out)
        x = runner.forward(lw, x)
        logger.info("layer %d/%d: %s in %.1fs", i + 1, cfg.num_hidden_layers,
                    ", ".join(f"{k} {v[0]:.3g} (rtn {v[1]:.3g})" for k, v in errors.items()), time.perf_counter() - t0)
    return out


def _store(out: dict, lw: LayerWeights, projs: list[str], settings: QuantizeSettings, gq: GroupQuant) -> None:
    """Split stacked codes back into their matrices, and put the dequantized weights into the state."""
    row = 0
    for proj in projs:
        n = lw.w(proj).shape[0]
        part = GroupQuant(gq.q[row:row + n], gq.scales[row:row + n], gq.zeros[row:row + n], gq.g_idx.clone(), gq.bits)
        row += n
        if not settings.kept(lw.name(proj)):
            out[lw.name(proj)] = part
            lw.state[lw.name(proj)] = part.dequantize().to(lw.w(proj).dtype)


def _todo(lw: LayerWeights, projs: tuple[str, ...], settings: QuantizeSettings) -> list[str]:
    return [p for p in projs if not settings.kept(lw.name(p))]


def _gptq_layer(lw: LayerWeights, runner: LlamaLayerRunner, x: torch.Tensor, settings: QuantizeSettings,
                out: dict) -> dict[str, tuple[float, float]]:
    errors = {}

    def quantize(projs: tuple[str, ...], inputs: torch.Tensor, label: str) -> None:
        todo = _todo(lw, projs, settings)
        if not todo:
            return
        h = hessian(inputs)
        w = torch.cat([lw.w(p) for p in todo]).float()
        gq = gptq_quantize(w, h, settings.bits, settings.group_size, settings.sym, settings.desc_act)
        rtn = rtn_quantize(w, settings.bits, settings.group_size, settings.sym)
        errors[label] = (_hessian_error(w, gq.dequantize(), h), _hessian_error(w, rtn.dequantize(), h))
        _store(out, lw, todo, settings, gq)

    attn_in = runner.attention_inputs(lw, x)  # (o_proj's inputs use the quantized q/k/v stored above)
    quantize(("q_proj", "k_proj", "v_proj"), attn_in, "qkv")
    quantize(("o_proj",), runner.attention_core(lw, attn_in), "o")
    _, h = runner.mlp_inputs(lw, x)
    quantize(("gate_proj", "up_proj"), h, "gate_up")
    quantize(("down_proj",), runner.down_inputs(lw, h), "down")
    return errors


def _hessian_error(w: torch.Tensor, wq: torch.Tensor, h: torch.Tensor) -> float:
    """Mean ||(W - W_q) x||^2 per input row, from H = 2 X X^T / n (the loss GPTQ minimizes)."""
    d = (w - wq).double()
    return (0.5 * torch.einsum("nk,kj,nj->", d, h, d)).item()


def _awq_layer(lw: LayerWeights, runner: LlamaLayerRunner, x: torch.Tensor, settings: QuantizeSettings,
               out: dict) -> dict[str, tuple[float, float]]:
    """Search and fold the scales of each input group, then round the scaled weights to nearest."""
    errors = {}
    st = lw.state

    def search(projs: tuple[str, ...], inputs: torch.Tensor, label: str) -> torch.Tensor | None:
        todo = _todo(lw, projs, settings)
        if not todo:
            return None
        s, best, rtn = search_scales(inputs, [lw.w(p) for p in todo], settings.bits, settings.group_size)
        errors[label] = (best, rtn)
        for p in projs:  # every reader of the input is scaled (a kept one stays float, still exact)
            st[lw.name(p)] = lw.w(p) * s
        return s

    def fold(key: str, s: torch.Tensor | None, rows: bool = False) -> None:
        if s is not None:  # the producer of the input divides by s: norm weight, or output rows (+ bias)
            st[key] = st[key] / (s[:, None] if rows else s)
            bias = key.removesuffix("weight") + "bias"
            if rows and bias in st:
                st[bias] = st[bias] / s

    fold(lw.prefix + "input_layernorm.weight",
         search(("q_proj", "k_proj", "v_proj"), runner.attention_inputs(lw, x), "qkv"))
    cfg = runner.cfg
    if cfg.num_attention_heads == cfg.num_key_value_heads:  # v's output channels are o's input channels
        fold(lw.name("v_proj"), search(("o_proj",), runner.attention_core(lw, runner.attention_inputs(lw, x)), "o"),
             rows=True)
    r, h = runner.mlp_inputs(lw, x)
    fold(lw.prefix + "post_attention_layernorm.weight", search(("gate_proj", "up_proj"), h, "gate_up"))
    h = runner.norm(r, lw.norm("post_attention_layernorm"))  # the folded norm; attention is unchanged
    fold(lw.name("up_proj"), search(("down_proj",), runner.down_inputs(lw, h), "down"), rows=True)
    for proj in ATTN + MLP:
        _store(out, lw, [proj], settings, rtn_quantize(lw.w(proj), settings.bits, settings.group_size, sym=False))
    return errors

