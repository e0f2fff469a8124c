"""Calibration data and a plain-torch Llama decoder layer for collecting the inputs of each linear.

`pagellm quantize` runs the float model one decoder layer at a time over all calibration samples
([samples, seq_len, hidden] at once: no KV cache, causal attention), so that GPTQ and AWQ see each
linear's real inputs, computed from the already-quantized earlier layers. The default text
(`calibration.txt`, see quantize_cli.DEFAULT_CALIBRATION) is
small: enough for 135M-class models at 4 bits; pass --calibration for a larger or domain-specific one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.model.layers.rotary import RotaryEmbedding
from pagellm.model_config import ModelConfig

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def calibration_tokens(tokenizer, path: str, num_samples: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """[num_samples, seq_len] token windows spread evenly over the encoded text (overlapping when the text is
    shorter than num_samples * seq_len); each starts with BOS when the tokenizer has one."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"calibration file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = getattr(tokenizer, "bos_token_id", None)
    body = seq_len - (bos is not None)
    if len(ids) < body:
        raise ValueError(f"calibration file {path} has {len(ids)} tokens; --seq-len {seq_len} needs at least {body}")
    if max(ids) >= vocab_size:
        raise ValueError(f"calibration tokens reach id {max(ids)}, outside the model's vocabulary of {vocab_size} "
                         "(is the tokenizer the model's?)")
    starts = torch.linspace(0, len(ids) - body, num_samples).round().long().tolist()
    rows = [([bos] if bos is not None else []) + ids[s:s + body] for s in starts]
    return torch.tensor(rows, dtype=torch.long)


def module_name(index: int, proj: str) -> str:
    """The Hugging Face name of decoder layer `index`'s projection `proj` (q_proj ... down_proj)."""
    return f"model.layers.{index}.{'self_attn' if proj in ATTN else 'mlp'}.{proj}"


class LayerWeights:
    """One decoder layer's tensors in a state dict of Hugging Face names (read and written in place)."""

    def __init__(self, state: dict[str, torch.Tensor], index: int):
        self.state, self.index, self.prefix = state, index, f"model.layers.{index}."

    def name(self, proj: str) -> str:
        return module_name(self.index, proj) + ".weight"

    def w(self, proj: str) -> torch.Tensor:
        return self.state[self.name(proj)]

    def bias(self, proj: str) -> torch.Tensor | None:
        return self.state.get(self.name(proj).removesuffix("weight") + "bias")

    def norm(self, which: str) -> torch.Tensor:
        return self.state[f"{self.prefix}{which}.weight"]


class LlamaLayerRunner:
    """The Llama/Mistral/Qwen2 decoder layer in plain torch over x [samples, seq_len, hidden]."""

    def __init__(self, cfg: ModelConfig, seq_len: int):
        self.cfg = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.positions = torch.arange(seq_len)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(dim=-1, keepdim=True)
        return x * torch.rsqrt(var + self.cfg.rms_norm_eps) * weight

    def attention_inputs(self, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """What q/k/v read: the input norm of x."""
        return self.norm(x, lw.norm("input_layernorm"))

    def attention_core(self, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        """Causal attention of h -> [samples, seq_len, heads * head_dim] (what o_proj reads)."""
        cfg = self.cfg
        n, seq, _ = h.shape
        heads, kv, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = F.linear(h, lw.w("q_proj"), lw.bias("q_proj")).reshape(n * seq, heads, dim)
        k = F.linear(h, lw.w("k_proj"), lw.bias("k_proj")).reshape(n * seq, kv, dim)
        v = F.linear(h, lw.w("v_proj"), lw.bias("v_proj")).reshape(n, seq, kv, dim)
        q, k = self.rotary.rotate(self.positions.repeat(n), q, k)
        q = q.reshape(n, seq, heads, dim).transpose(1, 2)
        k = k.reshape(n, seq, kv, dim).transpose(1, 2).repeat_interleave(heads // kv, dim=1)
        v = v.transpose(1, 2).repeat_interleave(heads // kv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.transpose(1, 2).reshape(n, seq, heads * dim)

    def mlp_inputs(self, lw: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual stream after attention, what gate/up read)."""
        x = x + F.linear(self.attention_core(lw, self.attention_inputs(lw, x)), lw.w("o_proj"))
        return x, self.norm(x, lw.norm("post_attention_layernorm"))

    @staticmethod
    def down_inputs(lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        return F.silu(F.linear(h, lw.w("gate_proj"))) * F.linear(h, lw.w("up_proj"))

    def forward(self, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        x, h = self.mlp_inputs(lw, x)
        return x + F.linear(self.down_inputs(lw, h), lw.w("down_proj"))


def embed(state: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    return F.embedding(tokens, state["model.embed_tokens.weight"])
